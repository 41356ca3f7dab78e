"""The Megatron backend on one GPU (TP = PP = EP = 1): logits equal transformers within bf16
tolerance, and training equals the FSDP backend on the same batch (fp32 and bf16 compute).

Every parity case runs in ONE rank process (a module fixture through `parity.run_cases`): the
first run spawned a process per case (ten CUDA + megatron start-ups) and ran past its time limit.
A failing case records its traceback and the others still run (`keep_going`), so one bad case
shows as one failed test. Each test has its own time limit; the rank process is killed on timeout.
Run on the accelerator machine with megatron-core installed from its wheel (no internet there):
    pip install --no-deps .whl/megatron_core-0.16.1-*.whl
    python -m pytest -v -s -m gpu --timeout 60 tests/gpu/test_megatron_cuda.py
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed"),
]
ARCHS = ("llama", "qwen3", "qwen3_moe")
# The shared fixture (one start-up, ~14 tiny cases) runs inside the first test's limit.
FIXTURE_LIMIT = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from milepost.train.megatron.parity import run_cases

    root = tmp_path_factory.mktemp("megatron_cuda")
    paths = {a: str(make_tiny_checkpoint(root / a, a, with_tokenizer=False)) for a in ARCHS}
    cases: dict[str, dict] = {}
    for dtype in ("float32", "bfloat16"):
        cases[f"logits_{dtype}"] = {"fn": "logits_gaps", "args": [[(paths[a], 1, 1) for a in ARCHS], dtype]}
        for arch in ("qwen3", "qwen3_moe"):
            overrides = {"device": "cuda", "dtype": dtype}
            cases[f"fsdp_{arch}_{dtype}"] = {"fn": "train_once", "args": [paths[arch], "fsdp", 1, 1, None, overrides]}
            cases[f"megatron_{arch}_{dtype}"] = {
                "fn": "train_once", "args": [paths[arch], "megatron", 1, 1, str(root / f"ckpt_{arch}_{dtype}"), overrides]}
    cases["offload"] = {"fn": "offload_round_trip", "args": [paths["qwen3"], 1, 1, {"device": "cuda"}]}
    # --use-distributed-optimizer (DP = 1 here: megatron's DDP buffers and DistributedOptimizer on CUDA)
    dopt = {"device": "cuda", "dtype": "float32", "use_distributed_optimizer": True}
    cases["megatron_qwen3_moe_float32_dopt"] = {
        "fn": "train_once", "args": [paths["qwen3_moe"], "megatron", 1, 1, str(root / "ckpt_dopt"), dopt]}
    cases["offload_dopt"] = {"fn": "offload_round_trip", "args": [paths["qwen3"], 1, 1, dopt]}
    [out] = run_ranks(run_cases, 1, cases, True, backend="nccl", timeout_s=200)
    print("case seconds:", out["seconds"])
    return out


def _case(one_gpu: dict, name: str) -> dict | list:
    result = one_gpu[name]
    if isinstance(result, dict) and "error" in result:
        pytest.fail(f"case {name} raised on the rank:\n{result['error']}")
    return result


@FIXTURE_LIMIT
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-3), ("bfloat16", 0.25)])
def test_logits_equal_transformers_on_cuda(one_gpu, dtype, tol):
    gaps = _case(one_gpu, f"logits_{dtype}")
    print(dtype, [(a, round(g["max_abs_diff"], 5)) for a, g in zip(ARCHS, gaps)])
    for arch, gap in zip(ARCHS, gaps):
        assert gap["ref_abs_max"] > 1.0
        # fp32 on CUDA: TF32-free matmuls may still reorder sums; bf16: a few ulps of logits ~5
        assert gap["max_abs_diff"] < tol, (arch, gap)


@FIXTURE_LIMIT
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trains_like_fsdp_on_cuda(one_gpu, arch, dtype):
    ref = _case(one_gpu, f"fsdp_{arch}_{dtype}")
    got = _case(one_gpu, f"megatron_{arch}_{dtype}")
    rel = 1e-3 if dtype == "float32" else 5e-2
    # In bf16 log-probs are rounded at ~0.03 (logits ~5), so: pg_clipfrac counts tokens (26 loss
    # tokens: steps of 0.038) whose ratio passes a 0.01 clip, and a token or two may cross it on one
    # backend only; ppo_kl and kl are means of log-prob differences over those 26 tokens, whose
    # rounding noise is ~0.03 / sqrt(26) = 0.006 (measured on the H200: MoE ppo_kl -0.0072 vs -0.0130)
    noise_abs = {} if dtype == "float32" else {"pg_clipfrac": 0.1, "ppo_kl": 0.015, "kl": 0.015}

    def near(key: str, a: float, b: float, rel: float, abs_: float) -> bool:
        return a == pytest.approx(b, rel=rel, abs=max(abs_, noise_abs.get(key, 0.0)))

    print(arch, dtype, {k: (round(v, 6), round(got["metrics"][0][k], 6)) for k, v in ref["metrics"][0].items()})
    misses = {k: (v, got["metrics"][0][k]) for k, v in ref["metrics"][0].items()
              if not near(k, got["metrics"][0][k], v, rel, rel * 0.1)}
    assert not misses, f"metrics (fsdp, megatron) outside rel {rel}: {misses}"
    atol = 1e-3 if dtype == "float32" else 2e-2
    gaps = {n: float((got["hf"][n].float() - w.float()).abs().max()) for n, w in ref["hf"].items()}
    worst = max(gaps, key=gaps.get)
    assert gaps[worst] <= atol, f"HF weights after training: {worst} differs by {gaps[worst]:.3g} (> {atol})"
    # resume: CUDA's atomics (MoE token scatter) may reorder sums, hence approx (and in bf16 that can
    # move a token across the clip)
    misses = {k: (v, got["again"][k]) for k, v in got["second"].items() if not near(k, got["again"][k], v, 1e-4, 1e-6)}
    assert not misses, f"second rollout (straight on, after reload) differs: {misses}"


@FIXTURE_LIMIT
def test_distributed_optimizer_trains_like_fsdp_on_cuda(one_gpu):
    """--use-distributed-optimizer on one GPU (fp32 Qwen3-MoE): the FSDP numbers and the AdamW
    path's, resume within 1e-4. Written in session 11 on a CPU machine; not yet run on a GPU."""
    ref, adamw = _case(one_gpu, "fsdp_qwen3_moe_float32"), _case(one_gpu, "megatron_qwen3_moe_float32")
    got = _case(one_gpu, "megatron_qwen3_moe_float32_dopt")
    for other in (ref, adamw):
        for key, value in other["metrics"][0].items():
            assert got["metrics"][0][key] == pytest.approx(value, rel=1e-3, abs=1e-4), key
        for name, weight in other["hf"].items():
            torch.testing.assert_close(got["hf"][name], weight, rtol=0, atol=1e-3)
    assert got["adam_bytes"] == adamw["adam_bytes"]  # DP = 1: one shard is all of it
    for key, value in got["second"].items():
        assert got["again"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@FIXTURE_LIMIT
@pytest.mark.parametrize("case", ["offload", "offload_dopt"])
def test_offload_frees_the_gpu_and_training_goes_on(one_gpu, case):
    """offload() moves weights, gradients and Adam state to host memory (the device memory drops
    by at least 90% of their bytes), a train step meanwhile is refused, and after onload() the
    second rollout equals the same two rollouts with no offload (fp32, dense Qwen3). offload_dopt:
    the same with --use-distributed-optimizer (megatron's buffer offload; not yet run on a GPU)."""
    got = _case(one_gpu, case)
    (before, during), moved = got["allocated_gib"], got["moved_gib"]
    print(f"offload: allocated {before * 2**10:.2f} -> {during * 2**10:.2f} MiB, tensors moved {moved * 2**10:.2f} MiB")
    assert moved > 0 and before - during >= 0.9 * moved
    assert "called while offloaded; call onload() first" in got["refused"]
    for a, b in zip(got["straight"]["metrics"], got["offload"]["metrics"]):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-7)
    for name, weight in got["straight"]["hf"].items():
        torch.testing.assert_close(got["offload"]["hf"][name], weight, rtol=0, atol=1e-6)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shape,layers", [("qwen3-0.6b", []), ("qwen3-30b-a3b", ["--layers", "2"])])
def test_bench_megatron_beside_fsdp(tmp_path, shape, layers, capsys):
    """Tokens/s and peak memory of both backends in one run (printed for the notes). The
    Megatron side runs megatron's local (unfused, O(T^2)) attention: micro-batches of 2048 tokens.
    30B-A3B: two layers only, one GPU. (.dev/s8/megatron.sh runs the bench CLI instead.)"""
    import json

    from milepost.bench.train import main

    out = tmp_path / "bench.json"
    assert main(["--shape", shape, *layers, "--samples", "8", "--prompt", "256", "--response", "256",
                 "--micro-batch-tokens", "2048", "--steps", "2", "--backend", "both", "--no-hf",
                 "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    print(capsys.readouterr().out)
    for side in ("milepost", "megatron"):
        assert report[side]["tokens_per_s"] > 0 and report[side]["peak_gib"] > 0
    assert report["megatron"]["grad_norm"] == pytest.approx(report["milepost"]["grad_norm"], rel=5e-2)
