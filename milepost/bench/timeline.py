"""Where a timed workload's wall time goes, step by step (`milepost bench engine --timeline`).

From the engine's per-step records (EngineStats.timeline): steps and host-timed seconds per kind
(prefill, mixed, decode), the time before the first step and between steps, and the inter-token
latency that running decodes see: a step's duration, counted once per decode row it carries, so
a large prefill chunk that stalls many decodes shows in the percentiles and the maximum.
"""

from __future__ import annotations

from collections.abc import Sequence

from milepost.engine.stats import StepRecord

KINDS = ("prefill", "mixed", "decode")


def summarize(steps: Sequence[StepRecord], t0: float, t1: float) -> dict:
    """The breakdown of one workload run from t0 to t1 (perf_counter seconds) as a JSON-ready dict."""
    run = [s for s in steps if s.chunks]
    out: dict = {"wall_s": t1 - t0, "steps": len(run)}
    for kind in KINDS:
        rows = [s for s in run if s.kind == kind]
        secs = sum(s.end - s.start for s in rows)
        out[kind] = {"steps": len(rows), "seconds": secs, "tokens": sum(s.tokens for s in rows),
                     "mean_ms": 1e3 * secs / len(rows) if rows else None}
    if run:
        out["before_first_step_s"] = run[0].start - t0
        out["after_last_step_s"] = t1 - run[-1].end
        out["between_steps_s"] = sum(b.start - a.end for a, b in zip(run, run[1:]))
    out["itl_ms"] = _weighted_percentiles([(1e3 * (s.end - s.start), s.decodes) for s in run if s.decodes])
    return out


def _weighted_percentiles(pairs: list[tuple[float, int]]) -> dict | None:
    """p50/p90/p99/max of values each counted `weight` times."""
    if not pairs:
        return None
    pairs = sorted(pairs)
    total = sum(w for _, w in pairs)
    res, seen, i = {}, 0, 0
    for q in (50, 90, 99):
        want = q / 100 * total
        while i < len(pairs) - 1 and seen + pairs[i][1] < want:
            seen += pairs[i][1]
            i += 1
        res[f"p{q}"] = pairs[i][0]
    res["max"] = pairs[-1][0]
    return res


def format_summary(name: str, s: dict) -> list[str]:
    """Plain-text lines of `summarize`'s result."""
    lines = [f"timeline {name}: wall {s['wall_s']:.3f} s, {s['steps']} steps"]
    for kind in KINDS:
        k = s[kind]
        if k["steps"]:
            lines.append(f"  {kind:8s} {k['steps']:4d} steps {k['seconds']:.3f} s, {k['tokens']:,} tokens, "
                         f"mean {k['mean_ms']:.2f} ms")
    if "between_steps_s" in s:
        lines.append(f"  before the first step {1e3 * s['before_first_step_s']:.1f} ms, between steps "
                     f"{1e3 * s['between_steps_s']:.1f} ms, after the last {1e3 * s['after_last_step_s']:.1f} ms")
    itl = s["itl_ms"]
    if itl:
        lines.append(f"  inter-token latency of running decodes: p50 {itl['p50']:.2f} ms, p90 {itl['p90']:.2f}, "
                     f"p99 {itl['p99']:.2f}, max {itl['max']:.2f}")
    return lines
