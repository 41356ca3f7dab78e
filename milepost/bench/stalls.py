"""What stalled a timed run besides the GPU work: Triton kernels compiled and full garbage
collections while it ran (`milepost bench engine` reports both per workload).

A Triton kernel compiles on the first launch of each specialization (constexprs, and integer
arguments that are 1 or divisible by 16), ~0.3-1 s each. One compiled inside a timed run means
the warm-up missed that specialization and the run's tok/s is not the engine's steady state
(session 22: the 30B-A3B shape ran 9.7k tok/s in a fresh process, 11.8k in the next run).
Generation-2 collections pause every thread of the process, the engine's included.
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Stall:
    what: str  # "compile <kernel>(<argument types>)" or "gc gen2"
    seconds: float


@dataclass
class StallWatch:
    """Records stalls between start() and stop() (or as a context manager); the hooks it adds
    chain to the ones already set and are restored by stop()."""

    events: list[Stall] = field(default_factory=list)
    compiles_visible: bool = False  # False: this Triton has no compile hooks (or no Triton)
    _begun: dict = field(default_factory=dict)
    _restore: list = field(default_factory=list)

    def start(self) -> StallWatch:
        self._hook_triton()
        gc.callbacks.append(self._on_gc)
        self._restore.append(lambda: gc.callbacks.remove(self._on_gc))
        return self

    def stop(self) -> None:
        while self._restore:
            self._restore.pop()()

    def __enter__(self) -> StallWatch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def since(self, mark: int) -> list[Stall]:
        """The stalls recorded after `len(self.events)` was `mark`."""
        return self.events[mark:]

    def _on_gc(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        key = ("gc", threading.get_ident())
        if phase == "start":
            self._begun[key] = time.perf_counter()
        elif key in self._begun:
            t0 = self._begun.pop(key)
            self.events.append(Stall("gc gen2", time.perf_counter() - t0))

    def _hook_triton(self) -> None:
        try:
            from triton import knobs
        except ImportError:  # no Triton, or one older than its knobs (3.4): nothing to watch
            return
        runtime = knobs.runtime
        if not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
            return
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

        def on_miss(*args: object, **kwargs: object) -> bool | None:
            self._begun[("jit", threading.get_ident())] = time.perf_counter()
            return before(*args, **kwargs) if before else None  # True would skip the compile

        def on_compiled(*args: object, **kwargs: object) -> object:
            t0 = self._begun.pop(("jit", threading.get_ident()), None)
            if t0 is not None:
                self.events.append(Stall("compile " + _short(str(kwargs.get("repr", "?"))),
                                         time.perf_counter() - t0))
            return after(*args, **kwargs) if after else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_miss, on_compiled
        self.compiles_visible = True

        def restore() -> None:
            runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
        self._restore.append(restore)


def _short(triton_repr: str) -> str:
    """`name[num_warps=..., ...](args)` -> `name(args)`: the options are the same for a kernel."""
    name, _, rest = triton_repr.partition("[")
    args = rest.partition("](")[2]
    return f"{name}({args}" if args else name


def summarize_stalls(stalls: list[Stall]) -> dict:
    """JSON-ready: count and seconds of each kind, and the compiled kernels' names."""
    compiles = [s for s in stalls if s.what.startswith("compile ")]
    gcs = [s for s in stalls if s.what == "gc gen2"]
    return {"compiles": len(compiles), "compile_seconds": sum(s.seconds for s in compiles),
            "compiled": [f"{s.what.removeprefix('compile ')} ({1e3 * s.seconds:.0f} ms)"
                         for s in compiles],
            "gc_gen2": len(gcs), "gc_gen2_seconds": sum(s.seconds for s in gcs),
            "gc_gen2_max_ms": 1e3 * max((s.seconds for s in gcs), default=0.0)}


def format_stalls(name: str, s: dict) -> list[str]:
    """Plain-text lines of `summarize_stalls`'s result; none when nothing stalled the run."""
    lines = []
    if s["compiles"]:
        lines.append(f"{name}: {s['compiles']} Triton kernel(s) compiled inside the timed run "
                     f"({s['compile_seconds']:.2f} s; the warm-up missed them):")
        lines.extend(f"  {c}" for c in s["compiled"])
    if s["gc_gen2"]:
        lines.append(f"{name}: {s['gc_gen2']} full garbage collection(s), {s['gc_gen2_seconds']:.3f} s "
                     f"(longest {s['gc_gen2_max_ms']:.1f} ms)")
    return lines
