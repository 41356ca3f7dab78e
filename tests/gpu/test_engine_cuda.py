"""The engine on a CUDA device: same greedy tokens as transformers, KV pool sized from memory.

Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milepost.engine.request import Request
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.testing.checkpoints import make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _generate(engine, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy, fixed-length generation straight through the engine (no HTTP)."""
    import threading

    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    remaining = [len(prompts)]
    all_done = threading.Event()

    def collector(i: int):
        def on_output(out) -> None:
            tokens[i].extend(out.new_token_ids)
            if out.finished:
                remaining[0] -= 1
                if remaining[0] == 0:
                    all_done.set()
        return on_output

    for i, ids in enumerate(prompts):
        engine.submit(Request(
            rid=str(i), prompt_ids=ids,
            params=SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True),
            on_output=collector(i), stop_ids=frozenset(),
        ))
    assert all_done.wait(120), "generation did not finish"
    return [tokens[i] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "llama"])
def test_cuda_greedy_matches_transformers(tmp_path: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    make_tiny_checkpoint(tmp_path, arch)
    prompts = [[5 + i for i in range(n)] for n in (3, 17, 40)]
    args = ServerArgs(model_path=tmp_path, device="cuda", dtype="float32").resolved()
    engine, info, _ = build_engine(args)
    # Pool sized from --mem-fraction-static: far more than the tiny model needs, but bounded.
    assert 0 < engine.cfg.num_blocks * engine.cfg.block_size
    engine.start()
    try:
        got = _generate(engine, prompts, 12)
    finally:
        engine.close()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).cuda()
    # The engine ignores EOS; transformers must neither stop at it nor ban it (min_new_tokens would).
    hf.generation_config.eos_token_id = None
    for ids, out in zip(prompts, got):
        ref = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=12,
                          do_sample=False)[0, len(ids):].tolist()
        if out == ref:
            continue
        # GPU kernels (SDPA variants, reduction order) differ from transformers' at ~1e-6, which can
        # flip an argmax only where the top two logits are practically tied: check that it was so.
        k = next(i for i, (a, b) in enumerate(zip(out, ref)) if a != b)
        with torch.no_grad():
            logits = hf(torch.tensor([ids + ref[:k]], device="cuda")).logits[0, -1].float()
        gap = (logits[ref[k]] - logits[out[k]]).abs().item()
        assert gap < 1e-4, f"diverged at token {k} with a logit gap of {gap}"
