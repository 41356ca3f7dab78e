"""bench.stalls: full collections recorded while a watch runs, Triton's compile hooks chained and
restored, and the report lines. A real compile is seen in tests/gpu/test_bench_stalls_cuda.py."""

from __future__ import annotations

import gc

import pytest

from milepost.bench.stalls import Stall, StallWatch, format_stalls, summarize_stalls


def test_full_collections_inside_the_watch_are_recorded_and_none_after() -> None:
    with StallWatch() as watch:
        gc.collect()
        gc.collect(0)  # young generation: not a stall worth reporting
    gc.collect()
    kinds = [s.what for s in watch.events]
    assert kinds == ["gc gen2"]
    assert watch.events[0].seconds >= 0.0
    assert watch._on_gc not in gc.callbacks


def test_triton_hooks_are_chained_and_restored() -> None:
    knobs = pytest.importorskip("triton").knobs
    seen = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(("miss", kw["repr"])) and None
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(("done", kw["repr"]))
    try:
        previous = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
        with StallWatch() as watch:
            assert watch.compiles_visible
            # Triton calls the two hooks with these keywords around each compile (JITFunction._do_compile)
            name = "_gate_up_kernel[num_warps=4, num_ctas=1](X: *bf16, n_pairs: i32)"
            assert not knobs.runtime.jit_cache_hook(key=1, repr=name, fn=None, compile={},
                                                    is_manual_warmup=False, already_compiled=False)
            knobs.runtime.jit_post_compile_hook(key=1, repr=name, fn=None, compile={},
                                                is_manual_warmup=False, already_compiled=False)
        assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == previous
    finally:
        knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
    assert seen == [("miss", name), ("done", name)]
    assert [s.what for s in watch.events] == ["compile _gate_up_kernel(X: *bf16, n_pairs: i32)"]


def test_summary_and_lines() -> None:
    stalls = [Stall("compile _finish_kernel(n: i32)", 0.9), Stall("gc gen2", 0.004),
              Stall("gc gen2", 0.002)]
    s = summarize_stalls(stalls)
    assert s["compiles"] == 1 and s["compiled"] == ["_finish_kernel(n: i32) (900 ms)"]
    assert s["gc_gen2"] == 2 and s["gc_gen2_max_ms"] == pytest.approx(4.0)
    lines = format_stalls("fixed", s)
    assert "1 Triton kernel(s) compiled inside the timed run (0.90 s" in lines[0]
    assert lines[1] == "  _finish_kernel(n: i32) (900 ms)"
    assert "2 full garbage collection(s)" in lines[2]
    assert format_stalls("fixed", summarize_stalls([])) == []
