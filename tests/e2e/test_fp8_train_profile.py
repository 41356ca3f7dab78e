"""benchmarks/fp8_train_profile.py runs on CPU at tiny sizes (`--device cpu --small`): the table's
columns and parts are all there, the fused kernels' bytes equal today's, the train-step profile
lists kernels. Its CPU numbers are not measurements of anything (GEMMs emulated, Triton interpreted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_profile_script_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/fp8_train_profile.py"), "--device", "cpu",
                          "--small", "--linears", "q", "--reps", "1", "--warmup", "0", "--check-bits",
                          "--profile-step", "--top", "3", "--json-out", str(out)],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads(out.read_text())
    (row,) = report["linears"]
    assert (row["N"], row["K"], row["tokens"]) == (256, 128, 200)
    for key in ("bf16_ms", "fp8_current_ms", "fp8_current_options_ms", "fp8_delayed_ms",
                "fp8_delayed_options_ms"):
        assert row[key] > 0
    parts = row["parts_ms"]
    for key in ("weight_quant_torch", "weight_quant_triton", "transpose_quant_copy", "transpose_quant_fused",
                "gemm_fwd", "gemm_dgrad", "gemm_wgrad", "bf16_gemm_wgrad"):
        assert parts[key] > 0
    assert row["bits_equal"] == {"weight": True, "transposed_operand": True, "tiled_rows": True}
    assert report["options"] == {"weight_quant": "triton", "act_quant": "tiled", "transpose": "fused"}
    steps = report["profile_step"]
    assert len(steps["unfused"]["top"]) == 3 and len(steps["options"]["top"]) == 3
    assert steps["bf16"]["step_ms"] > 0 and steps["unfused"]["step_ms"] > 0
    assert "FP8 current-scaling parts" in res.stdout
