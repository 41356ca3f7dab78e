"""A finished request's routed experts are read from the device without waiting for it: the final
output waits until the copy is done (`RoutedCopy.ready`), later requests' finals queue behind it
in order, and once the engine has no other work it waits for them all. Tiny Qwen3-MoE, CPU,
stepped in-process; a copy that is never ready stands in for one still behind a GPU step."""

from __future__ import annotations

from pathlib import Path

import pytest

from milepost.engine.request import Request
from milepost.engine.runner import RoutedCopy
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.testing.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("routed") / "moe", "qwen3_moe", seed=5,
                                with_tokenizer=False)


def run(ckpt: Path) -> tuple[dict[str, str], list[tuple[int, str]]]:
    """Routed experts per rid, and (step, rid) of each final output."""
    args = ServerArgs(model_path=ckpt, device="cpu", dtype="float32", page_size=4,
                      max_total_tokens=512).resolved()
    engine = build_engine(args)[0]
    routed: dict[str, str] = {}
    finals: list[tuple[int, str]] = []
    step = [0]

    def on_output(rid: str):
        def put(o) -> None:  # noqa: ANN001
            if o.finished:
                routed[rid] = o.routed_experts
                finals.append((step[0], rid))
        return put

    for rid, n in (("short", 3), ("mid", 6), ("long", 12)):
        engine.submit(Request(rid=rid, prompt_ids=[5, 9, 13, 17, 21], on_output=on_output(rid),
                              stop_ids=frozenset(), return_routed_experts=True,
                              params=SamplingParams(max_new_tokens=n, temperature=0.0,
                                                    ignore_eos=True)))
    engine._drain_inbox(block=False)
    while engine.scheduler.has_work:
        engine.step()
        step[0] += 1
    return routed, finals


def test_finals_wait_for_their_routed_experts_in_order(ckpt, monkeypatch) -> None:
    ready_routed, ready_finals = run(ckpt)
    assert [rid for _, rid in ready_finals] == ["short", "mid", "long"]
    assert ready_finals[0][0] < ready_finals[1][0] < ready_finals[2][0], "emitted as they finish"

    monkeypatch.setattr(RoutedCopy, "ready", lambda self: False)  # always behind the GPU
    late_routed, late_finals = run(ckpt)
    last = ready_finals[-1][0]
    assert late_finals == [(last, "short"), (last, "mid"), (last, "long")], \
        "held until the engine had no other work, then all in finishing order"
    assert late_routed == ready_routed and all(late_routed.values())
