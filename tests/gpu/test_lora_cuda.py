"""LoRA on CUDA: the engine's stacked adapter path inside decode CUDA graphs against merged-weights
engines, and the FSDP2 trainer training one adapter, and two (multi-LoRA), in bf16.

Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_lora_cuda.py`.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from milepost.engine.request import Request
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.lora.peft_format import write_peft_adapter
from milepost.lora.settings import LoraSettings
from milepost.testing.batches import random_train_batch
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.testing.lora_adapters import dequantized_checkpoint, merged_checkpoint, random_adapter
from milepost.train.fsdp import FSDPBackend, TrainerSettings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5 + (7 * i + j) % 400 for j in range(n)] for i, n in enumerate((3, 17, 40, 9, 1, 23))]
ADAPTERS = {"math": (LoraSettings(8, 16.0, "all-linear"), 1), "chat": (LoraSettings(4, 4.0, "q_proj,v_proj,down_proj"), 2)}


def _engine(path: Path, dtype: str, **kw):
    args = ServerArgs(model_path=path, device="cuda", dtype=dtype, page_size=16, max_total_tokens=8192,
                      chunked_prefill_size=64, attention_backend="triton", cuda_graph_max_bs=32, **kw).resolved()
    engine = build_engine(args)[0]
    engine.start()
    return engine


def _run(engine, jobs: list[tuple[list[int], str | None]], new: int) -> list[dict]:
    """Greedy, all submitted at once (one batch); prompt and output log-probs of each job."""
    outs = [{"ids": [], "lp": [], "prompt_lp": None} for _ in jobs]
    left, done = [len(jobs)], threading.Event()

    def collector(i: int):
        def on_output(o) -> None:
            outs[i]["ids"] += o.new_token_ids
            outs[i]["lp"] += o.new_logprobs
            if outs[i]["prompt_lp"] is None and o.input_logprobs:
                outs[i]["prompt_lp"] = list(o.input_logprobs[1:])
            if o.finished:
                left[0] -= 1
                if left[0] == 0:
                    done.set()
        return on_output

    for i, (ids, lora) in enumerate(jobs):
        engine.submit(Request(rid=str(i), prompt_ids=ids, on_output=collector(i), stop_ids=frozenset(),
                              params=SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True),
                              return_logprob=True, logprob_start_len=0, lora_name=lora))
    assert done.wait(300), "generation did not finish"
    return outs


@pytest.mark.parametrize(("dtype", "quantization"), [("float32", None), ("bfloat16", None), ("bfloat16", "fp8")])
def test_stacked_adapters_in_cuda_graphs_equal_merged_engines(tmp_path: Path, dtype: str, quantization: str | None) -> None:
    """Two adapters (ranks 8 and 4, different targets) and the base mixed in every batch, decode
    through CUDA graphs; each request's log-probs equal a merged-weights engine's: within 2e-4 in
    fp32 (sums in another order), within bf16 tolerance in bf16 (the merged weights are rounded
    once, the adapter's delta separately), up to the first greedy divergence. With
    `--quantization fp8` the base is stored in fp8 rows and the references merge the adapters
    into its dequantized values."""
    base = make_tiny_checkpoint(tmp_path / "base", "qwen3", with_tokenizer=False)
    ref_base = (dequantized_checkpoint(base, tmp_path / "dequantized", getattr(torch, dtype)) if quantization
                else base)
    specs, merged = [], {None: ref_base}
    for name, (settings, seed) in ADAPTERS.items():
        tensors = random_adapter(base, settings, seed, scale=0.1)
        write_peft_adapter(tensors.items(), settings, base, tmp_path / name)
        specs.append(f"{name}={tmp_path / name}")
        merged[name] = merged_checkpoint(ref_base, tmp_path / f"merged_{name}", settings, tensors)
    engine = _engine(base, dtype, enable_lora=True, max_lora_rank=8, max_loras_per_batch=4,
                     lora_paths=",".join(specs), quantization=quantization)
    try:
        assert engine.runner.lora.kernel == "stacked"
        graphs = engine.runner.graphs
        assert graphs is not None and graphs.captured  # kept with adapters
        replays, run = [], graphs.run

        def counted(*args, **kwargs):
            out = run(*args, **kwargs)
            replays.append(out is not None)
            return out

        graphs.run = counted
        jobs = [(p, lora) for p in PROMPTS for lora in ("math", None, "chat")]  # 18 decode rows -> graph 24
        got = _run(engine, jobs, 16)
        assert sum(replays) >= 10, replays  # the mixed decode steps ran in the graphs
    finally:
        engine.close()
    tol = (2e-4, 2e-4) if dtype == "float32" else (0.03, 0.25)  # (mean, max) |difference|
    for lora, path in merged.items():
        ref_engine = _engine(path, dtype)
        try:
            ref = _run(ref_engine, [(p, None) for p in PROMPTS], 16)
        finally:
            ref_engine.close()
        mine = [o for (p, name), o in zip(jobs, got) if name == lora]
        diffs = []
        for a, b in zip(mine, ref):
            diffs.append((torch.tensor(a["prompt_lp"]) - torch.tensor(b["prompt_lp"])).abs())
            k = next((i for i, (x, y) in enumerate(zip(a["ids"], b["ids"])) if x != y), len(a["ids"]))
            diffs.append((torch.tensor(a["lp"][:k]) - torch.tensor(b["lp"][:k])).abs())
        d = torch.cat(diffs)
        print(f"lora={lora} dtype={dtype} quantization={quantization}: |dlogp| mean {d.mean():.4f} max {d.max():.4f}")
        assert d.mean() < tol[0] and d.max() < tol[1], (lora, dtype, d.mean().item(), d.max().item())
    math0, base0 = got[0]["prompt_lp"], got[1]["prompt_lp"]
    assert max(abs(a - b) for a, b in zip(math0, base0)) > 1e-2  # the adapter changes the model


def _train_worker(rank: int, world: int, path: str, multi: bool) -> dict:
    lora = {"lora_rank": 8, "lora_alpha": 16.0}
    if multi:
        lora["lora_adapters"] = (("add", 1e-2), ("sub", 1e-2))
    s = TrainerSettings(lr=1e-2, global_batch_size=4, max_tokens_per_micro_batch=48, device="cuda",
                        dtype="bfloat16", **lora)
    backend = FSDPBackend.create(path, s)
    batch = random_train_batch(4, 0)
    if multi:
        batch = dataclasses.replace(batch, adapters=["add"] * 4)
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()
            for n, p in backend.policy.lm.named_parameters()}
    metrics = backend.train_step(batch)
    after = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()
             for n, p in backend.policy.lm.named_parameters()}
    changed = sorted(n for n in full if not torch.equal(full[n], after[n]))
    return {"loss": metrics["loss"], "changed": changed, "sent": sorted(n for n, _ in backend.named_hf_weights())}


@pytest.mark.parametrize("multi", [False, True])
def test_lora_trains_only_adapters_on_cuda(tmp_path: Path, multi: bool) -> None:
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3", with_tokenizer=False)
    [r] = run_ranks(_train_worker, 1, str(path), multi, backend="nccl")
    assert r["changed"] and all(".lora_B." in n or ".lora_A." in n for n in r["changed"])
    if multi:  # only 'add' had samples; its B moved, nothing of 'sub' did
        assert all(".add." in n for n in r["changed"])
        assert {n.split("/")[0] for n in r["sent"]} == {"add", "sub"}  # the first update sends all
    else:
        assert all(n.startswith("policy/") for n in r["sent"])


def _moe_train_worker(rank: int, world: int, path: str) -> dict:
    s = TrainerSettings(lr=1e-2, global_batch_size=4, max_tokens_per_micro_batch=48, device="cuda",
                        dtype="bfloat16", lora_rank=8, lora_alpha=16.0)
    backend = FSDPBackend.create(path, s)
    named = lambda: {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()  # noqa: E731
                     for n, p in backend.policy.lm.named_parameters()}
    before = named()
    backend.train_step(random_train_batch(4, 0))
    after = named()
    return {"changed": sorted(n for n in before if not torch.equal(before[n], after[n])),
            "base_dtypes": sorted({str(p.dtype) for n, p in backend.policy.lm.named_parameters() if ".lora_" not in n})}


def test_moe_expert_adapters_on_cuda(tmp_path: Path) -> None:
    """Qwen3-MoE experts (grouped GEMMs): the engine merges an expert adapter (bf16, decode CUDA
    graphs) and equals the merged-weights engine within bf16 tolerance; the trainer (bf16 base,
    fp32 adapters, fused grouped experts) moves the expert adapters' B and nothing of the base.
    Written in session 11 without a device: not run yet."""
    base = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", with_tokenizer=False)
    settings = LoraSettings(8, 16.0, "all-linear")
    tensors = random_adapter(base, settings, 1, scale=0.1)
    write_peft_adapter(tensors.items(), settings, base, tmp_path / "x")
    merged = merged_checkpoint(base, tmp_path / "merged", settings, tensors)
    engine = _engine(base, "bfloat16", enable_lora=True, max_lora_rank=8, max_loras_per_batch=1,
                     lora_paths=f"x={tmp_path / 'x'}")
    try:
        got = _run(engine, [(p, "x") for p in PROMPTS], 16)
    finally:
        engine.close()
    ref_engine = _engine(merged, "bfloat16")
    try:
        ref = _run(ref_engine, [(p, None) for p in PROMPTS], 16)
    finally:
        ref_engine.close()
    d = torch.cat([(torch.tensor(a["prompt_lp"]) - torch.tensor(b["prompt_lp"])).abs() for a, b in zip(got, ref)])
    print(f"moe expert adapter bf16: |dlogp| mean {d.mean():.4f} max {d.max():.4f}")
    assert d.mean() < 0.03 and d.max() < 0.25
    [r] = run_ranks(_moe_train_worker, 1, str(base), backend="nccl")
    assert r["base_dtypes"] == ["torch.bfloat16"]
    assert any(".mlp.experts." in n and ".lora_B." in n for n in r["changed"])
    assert all(".lora_" in n for n in r["changed"])
