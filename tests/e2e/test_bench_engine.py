"""`milepost bench engine` end to end on CPU at tiny size: the real CLI, every scenario, both sides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from milepost.cli import main

FLAGS = ["--shape", "tiny", "--requests", "6", "--prompt-len", "16", "--output-len", "8",
         "--mixed-min", "4", "--mixed-max", "20", "--sessions", "2", "--turns", "3",
         "--turn-user-len", "8", "--turn-output-len", "8", "--prefill-requests", "3",
         "--prefill-len", "40", "--peak-bandwidth", "1e11"]


def _bench(*flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "milepost", "bench", "engine", *flags],
                          capture_output=True, text=True, timeout=300, env=env)


def test_bench_engine_tiny_cpu(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = _bench(*FLAGS, "--json-out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for col in ("milepost tok/s", "transformers tok/s", "ratio", "of bandwidth bound"):
        assert col in proc.stdout
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["dtype"] == "float32"
    rows = {r["scenario"]: r for r in result["scenarios"]}
    assert list(rows) == ["fixed", "mixed", "multiturn", "prefill"]
    assert rows["fixed"]["tokens"] == 6 * 8 and rows["fixed"]["prompt_tokens"] == 6 * 16
    assert rows["prefill"]["counted_tokens"] == "prompt" and rows["prefill"]["tokens"] == 3 * 40
    assert 6 * 4 <= rows["mixed"]["tokens"] <= 6 * 20
    turns = rows["multiturn"]
    assert turns["requests"] == 6 and turns["output_tokens"] == 6 * 8
    # turn t+1 = turn t's prompt + answer + 8 user tokens: 16, 32, 48 tokens per session
    assert turns["prompt_tokens"] == 2 * (16 + 32 + 48)
    # later turns reuse all the KV of the previous turn: prompt + answer - 1 (the last sampled
    # token never went through the model) = 23 and 39 tokens (whole blocks + a copied tail)
    assert turns["prefix_cache_hit_rate_later_turns"] == (23 + 39) / 80
    assert turns["prefix_cache_hit_rate"] == (23 + 39) / 96
    for r in rows.values():
        assert r["milepost_tok_s"] > 0 and r["hf_tok_s"] > 0
        assert abs(r["ratio"] - r["milepost_tok_s"] / r["hf_tok_s"]) < 1e-9
    for name in ("fixed", "mixed", "multiturn"):
        r = rows[name]
        assert r["decode_steps"] > 0 and r["decode_step_ms"] > 0
        assert r["bandwidth_fraction"] == r["decode_bytes_per_s"] / 1e11
        # and against a copy timed in the same run (a CPU's memcpy: well above 100 MB/s)
        assert result["copy_bandwidth"] > 1e8
        assert r["copy_bandwidth_fraction"] == r["decode_bytes_per_s"] / result["copy_bandwidth"]
    assert "a cpu memory copy in this run" in proc.stdout
    for r in rows.values():  # CPU: no Triton compiles; full collections counted, if any
        assert r["stalls"]["compiles"] == 0 and r["stalls"]["gc_gen2"] >= 0


def test_bench_engine_groups_share_their_first_prompt(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = _bench(*FLAGS, "--scenarios", "multiturn", "--group-size", "2", "--no-hf",
                  "--json-out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["scenarios"]
    assert row["scenario"] == "multiturn-g2"
    # as above, plus the second session's first turn: 15 of the shared 16 prompt tokens
    assert row["prefix_cache_hit_rate"] == (2 * (23 + 39) + 15) / 192
    proc = _bench(*FLAGS, "--scenarios", "multiturn", "--group-size", "3", "--no-hf")
    assert proc.returncode == 2 and "--group-size" in proc.stderr


def _bench_in_process(capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str]:
    """The same CLI entry point in this process: a refusal needs no process start-up."""
    try:
        code = main(["bench", "engine", *flags])
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def test_bench_engine_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _bench_in_process(capsys, "--shape", "tiny", "--scenarios", "fixed,bogus")
    assert code == 2 and "--scenarios" in err and "bogus" in err
    code, err = _bench_in_process(capsys, "--shape", "tiny", "--scenarios", "fixed", "--prompt-len", "4000",
                                  "--output-len", "200", "--no-hf")
    assert code == 2 and "context" in err and "fixed" in err
