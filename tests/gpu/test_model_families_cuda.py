"""Native families and the transformers fallback on CUDA (fp32, so tokens must match exactly):
greedy through the engine (Triton paged attention for plain layers, masked_attention.py for
windowed / soft-capped / sink / MLA layers) equal to transformers `generate` on the same GPU.

Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_model_families_cuda.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from milepost.engine.request import Request
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.testing.hf_archs import make_tiny_hf_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
CASES = [  # (tiny arch, --model-impl)
    ("qwen2", "native"), ("mistral", "native"), ("gemma2", "native"), ("gemma3", "native"),
    ("gpt_oss", "native"), ("deepseek_v3", "native"), ("phi3", "transformers"), ("gemma2", "transformers"),
]


@pytest.mark.parametrize("arch, impl", CASES)
def test_engine_greedy_equals_generate_on_cuda(tmp_path: Path, arch: str, impl: str) -> None:
    path = make_tiny_hf_checkpoint(tmp_path / arch, arch)
    args = ServerArgs(model_path=path, device="cuda", dtype="float32", page_size=4, model_impl=impl,
                      chunked_prefill_size=8, max_total_tokens=512, max_running_requests=8).resolved()
    engine = build_engine(args)[0]
    assert getattr(engine.runner.model, "native", True) == (impl == "native")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (12, 3, 7, 20)]
    got: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.submit(Request(rid=str(i), prompt_ids=p, stop_ids=frozenset(),
                              params=SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True),
                              on_output=lambda o, i=i: got.setdefault(i, []).extend(o.new_token_ids)))
    engine._drain_inbox(block=False)
    while engine.scheduler.has_work:
        engine.step()
    engine._flush()
    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").to("cuda").eval()
    ref.generation_config.eos_token_id = None
    cfg = GenerationConfig(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p], device="cuda"), generation_config=cfg)[0, len(p):].tolist()
        assert got[i] == want, f"{arch} ({impl}) request {i}"
