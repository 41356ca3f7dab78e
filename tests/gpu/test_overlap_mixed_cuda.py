"""The overlap schedule launching mixed steps ahead on CUDA (decode graphs, the eager mixed path,
tokens fed on the device at their flat positions): greedy tokens and log-probs equal an engine
without the overlap schedule.

Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_overlap_mixed_cuda.py`.
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

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, 500, (n,), generator=g).tolist() for n in (7, 90, 33, 140, 2, 61, 18, 75)]


def _drive(path: Path, overlap: str) -> tuple[dict, int]:
    """Steps an engine in-process: 3 requests at most running (the rest queue), prompts split in
    chunks of 32, two late submissions; returns {rid: (tokens, logprobs)} and the fed forwards."""
    args = ServerArgs(model_path=path, device="cuda", dtype="float32", page_size=16,
                      max_total_tokens=8192, chunked_prefill_size=32, max_running_requests=3,
                      cuda_graph_max_bs=8, overlap_schedule=overlap).resolved()
    engine = build_engine(args)[0]
    out: dict[str, tuple[list[int], list[float]]] = {}
    fed = [0]
    forward = engine.runner.forward

    def counting(chunks, feed=None):  # noqa: ANN001, ANN202
        fed[0] += feed is not None and any(c.length > 1 for c in chunks)
        return forward(chunks, feed)

    engine.runner.forward = counting

    def submit(i: int, prompt: list[int]) -> None:
        rid = f"r{i}"
        out[rid] = ([], [])

        def on_output(o) -> None:  # noqa: ANN001
            out[rid][0].extend(o.new_token_ids)
            out[rid][1].extend(o.new_logprobs)

        engine.submit(Request(rid=rid, prompt_ids=prompt, on_output=on_output, stop_ids=frozenset(),
                              return_logprob=True,
                              params=SamplingParams(max_new_tokens=12 + 5 * (i % 3),
                                                    temperature=0.0, ignore_eos=True)))
        engine._drain_inbox(block=False)

    try:
        ps = _prompts()
        for i in range(6):
            submit(i, ps[i])
        for _ in range(5):
            engine.step()
        submit(6, ps[6])
        engine.step()
        submit(7, ps[7])
        while engine.scheduler.has_work:
            engine.step()
        engine._flush()
    finally:
        engine.close()
    return out, fed[0]


def test_mixed_steps_ahead_equal_no_overlap(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path, "qwen3")
    on, fed = _drive(tmp_path, "on")
    off, none = _drive(tmp_path, "off")
    assert fed > 0, "no mixed step was launched ahead"
    assert none == 0
    for rid in off:
        assert on[rid][0] == off[rid][0], rid
        assert torch.allclose(torch.tensor(on[rid][1]), torch.tensor(off[rid][1]), atol=1e-4), rid
