"""Rank functions that compare the Megatron backend with transformers and with the FSDP backend.

Used by the CPU tests (gloo, through milepost.testing.dist.run_ranks) and by the GPU test (nccl):
`logits_gap` (a packed forward vs transformers' logits), `train_once` (a rollout of training, the
weights after, exact resume) and `run_cases` (many of those in one process per rank: on CPU a
rank's start-up, ~5 s of imports, costs more than a tiny model's case).
"""

from __future__ import annotations

from pathlib import Path

import torch

from milepost.train.megatron.cpu_shim import block_causal_mask
from milepost.train.megatron.provider import init_parallel, load_hf_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def sequences(vocab_size: int, lengths: tuple[int, ...] = (12, 7), seed: int = 0) -> list[torch.Tensor]:
    """Fixed token sequences (ids >= 3 keep clear of the tiny tokenizer's special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g) for n in lengths]


def logits_gaps(rank: int, world_size: int, cases: list[tuple[str, int, int]],
                dtype: str = "float32") -> list[dict[str, float]]:
    """`logits_gap` for each (path, tp, ep) case in turn, in one process (one start-up, many checks)."""
    from megatron.core import parallel_state as ps

    out = []
    for path, tp, ep in cases:
        out.append(logits_gap(rank, world_size, path, tp=tp, ep=ep, dtype=dtype))
        ps.destroy_model_parallel()
    return out


def logits_gap(rank: int, world_size: int, path: str, tp: int = 1, pp: int = 1, ep: int = 1,
               dtype: str = "float32") -> dict[str, float]:
    """Max |Megatron logits - transformers logits| over a packed pair of sequences (pp = 1)."""
    import transformers

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    init_parallel(tp, pp, ep)
    model, shape = load_hf_model(path, tp=tp, pp=pp, ep=ep, dtype=DTYPES[dtype])
    model.to(device).eval()
    seqs = sequences(shape.vocab_size)
    lengths = [len(s) for s in seqs]
    total = sum(lengths)
    pad = -total % tp if shape.is_moe else 0  # sequence parallel (MoE under TP) splits the tokens over TP
    ids = torch.cat([*seqs, torch.zeros(pad, dtype=torch.int64)])[None].to(device)
    pos = torch.cat([torch.arange(n) for n in lengths + [pad]])[None].to(device)
    mask = block_causal_mask(lengths + [pad] if pad else lengths, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    with torch.no_grad(), autocast:
        out = model(ids, pos, attention_mask=mask)[0][:total].float()
    hf = transformers.AutoModelForCausalLM.from_pretrained(Path(path), dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        ref = torch.cat([hf(s[None].to(device)).logits[0] for s in seqs])
    return {"max_abs_diff": float((out - ref).abs().max()), "ref_abs_max": float(ref.abs().max()),
            "rank": float(rank)}


# Settings of the backend-parity runs: two optimizer steps per rollout, several micro-batches,
# a reference model with a KL term, an entropy bonus, and clip ranges tight enough to clip.
PARITY_SETTINGS = {"lr": 1e-3, "lr_warmup_iters": 1, "global_batch_size": 4, "max_tokens_per_micro_batch": 40,
                       "use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "k3", "entropy_coef": 0.01,
                       "eps_clip": 0.01, "eps_clip_high": 0.02}


def random_routings(path: str, tokens: list[torch.Tensor], seed: int = 7) -> list[torch.Tensor]:
    """Random engine routings for R3 tests: per sample [len - 1, layers, top_k] distinct expert ids."""
    import json

    config = json.loads((Path(path) / "config.json").read_text())
    experts = config.get("num_experts") or config["num_local_experts"]
    layers, k = config["num_hidden_layers"], config["num_experts_per_tok"]
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(t.numel() - 1, layers, experts, generator=g).argsort(-1)[..., :k] for t in tokens]


def train_once(rank: int, world_size: int, path: str, backend: str = "megatron", tp: int = 1, ep: int = 1,
               checkpoint_dir: str | None = None, overrides: dict | None = None, pp: int = 1) -> dict:
    """One rollout of 8 random samples (2 optimizer steps) on `backend`; metrics, HF weights after,
    and the log-probs of fixed probes. With `checkpoint_dir`: save after the first rollout, train a
    second one, reload and train it again (the two second-rollout results must be equal)."""
    from milepost.testing.batches import random_train_batch
    from milepost.train.batch import split_for_rank
    from milepost.train.settings import TrainerSettings
    from milepost.types import Sample

    settings = TrainerSettings(**{**PARITY_SETTINGS, **(overrides or {})})
    if backend == "fsdp":
        from milepost.train.fsdp import FSDPBackend

        trainer = FSDPBackend.create(path, settings)
        data_rank, data_world = rank, world_size
    else:
        from milepost.train.megatron.backend import MegatronBackend
        from milepost.train.megatron.parallel import ParallelSizes

        trainer = MegatronBackend.create(path, settings, ParallelSizes(tp=tp, ep=ep, pp=pp))
        data_rank, data_world = trainer.data_rank, trainer.data_world

    def mine(batch):
        if settings.use_rollout_routing_replay:
            batch.routed_experts = random_routings(path, batch.tokens)
        return batch.select(split_for_rank([t.numel() for t in batch.tokens], data_rank, data_world,
                                           settings.global_batch_size))

    metrics = [trainer.train_step(mine(random_train_batch(8, 1)))]
    # the Adam moments this rank holds, in bytes (the distributed optimizer keeps its 1/DP shard)
    state = trainer.optimizer_state_tensors() if backend == "megatron" else []
    adam_bytes = sum(t.numel() * t.element_size() for t in state)
    probe = [Sample(0, 0, tokens=list(range(3, 3 + k)), response_length=k - 2) for k in (5, 9, 13)]
    if settings.use_rollout_routing_replay:
        import base64

        for s, r in zip(probe, random_routings(path, [torch.tensor(s.tokens) for s in probe])):
            s.routed_experts = base64.b64encode(r.to(torch.int32).numpy().tobytes()).decode()  # SGLang's format
    out = {"metrics": metrics, "hf": {n: t.clone().cpu() for n, t in trainer.named_hf_weights()},
           "adam_bytes": adam_bytes,
           "logprobs": trainer.compute_logprobs(probe), "ref_logprobs": trainer.compute_logprobs(probe, reference=True)}
    if checkpoint_dir is not None:
        trainer.save_checkpoint(checkpoint_dir, {"step": 1})
        second = mine(random_train_batch(8, 2))
        out["second"] = trainer.train_step(second)
        out["second_hf"] = {n: t.clone().cpu() for n, t in trainer.named_hf_weights()}
        out["extra"] = trainer.load_checkpoint(checkpoint_dir)
        out["again"] = trainer.train_step(second)
        out["again_hf"] = {n: t.clone().cpu() for n, t in trainer.named_hf_weights()}
    return out


def offload_round_trip(rank: int, world_size: int, path: str, tp: int = 1, ep: int = 1,
                       overrides: dict | None = None) -> dict:
    """Two rollouts with offload / onload between them, then the same two rollouts on a fresh
    backend without: metrics and HF weights of both, the refusal of a train step while offloaded,
    and (CUDA) the device memory this rank's tensors held before and during the offload."""
    import gc

    from milepost.testing.batches import random_train_batch
    from milepost.train.batch import split_for_rank
    from milepost.train.megatron.backend import MegatronBackend
    from milepost.train.megatron.parallel import ParallelSizes
    from milepost.train.settings import TrainerSettings

    settings = TrainerSettings(**{**PARITY_SETTINGS, **(overrides or {})})
    cuda = settings.device == "cuda"
    out: dict = {}
    for run in ("offload", "straight"):
        trainer = MegatronBackend.create(path, settings, ParallelSizes(tp=tp, ep=ep))
        batches = [random_train_batch(8, seed) for seed in (1, 2)]
        mine = [b.select(split_for_rank([t.numel() for t in b.tokens], trainer.data_rank, trainer.data_world,
                                        settings.global_batch_size)) for b in batches]
        metrics = [trainer.train_step(mine[0])]
        if run == "offload":
            held = trainer.device_tensors()  # weights, gradients, Adam state, reference
            # Counted, then let go: a reference kept here would hold the old device tensors that
            # offload replaces (the first H200 run of this case measured its own list: 0.82 of 1.63 MiB).
            out["moved_gib"] = sum(t.numel() * t.element_size() for t in held) / 2**30
            del held
            before = torch.cuda.memory_allocated() if cuda else 0
            trainer.offload()
            out["allocated_gib"] = (before / 2**30, torch.cuda.memory_allocated() / 2**30 if cuda else 0.0)
            try:
                trainer.train_step(mine[1])
                out["refused"] = ""
            except RuntimeError as err:
                out["refused"] = str(err)
            trainer.onload()
        metrics.append(trainer.train_step(mine[1]))
        out[run] = {"metrics": metrics, "hf": {n: t.clone().cpu() for n, t in trainer.named_hf_weights()}}
        del trainer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return out


def wrong_split(rank: int, world_size: int, path: str) -> str:
    """TP = 2 peers given different samples (an FSDP-style split by global rank): the error message."""
    from milepost.testing.batches import random_train_batch
    from milepost.train.megatron.backend import MegatronBackend
    from milepost.train.megatron.parallel import ParallelSizes
    from milepost.train.settings import TrainerSettings

    trainer = MegatronBackend.create(path, TrainerSettings(global_batch_size=2), ParallelSizes(tp=2))
    try:
        trainer.train_step(random_train_batch(4, 1).select([rank, rank + 2]))
    except ValueError as err:
        return str(err)
    return "trained"


def pipeline_grads(rank: int, world_size: int, path: str, pp: int, micro_batches: int = 2,
                   seq_len: int = 16) -> dict:
    """megatron-core's own schedule (`get_forward_backward_func`) over fixed micro-batches: the
    losses (last stage) and this stage's gradients, layers numbered globally (PP = 1: the reference).

    Not the backend's path (that is pipeline.py): megatron's schedule alone, the evidence that it
    runs on CPU with the shim (docs/megatron.md)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    init_parallel(1, pp, 1)
    model, shape = load_hf_model(path, pp=pp)
    g = torch.Generator().manual_seed(0)
    data = iter([torch.randint(3, shape.vocab_size, (1, seq_len), generator=g) for _ in range(micro_batches)])
    mask = block_causal_mask([seq_len], torch.device("cpu"))

    def forward_step(batches, model):
        out = model(next(batches), torch.arange(seq_len)[None], attention_mask=mask)

        def loss_func(logits):
            loss = logits.float().logsumexp(-1).mean()
            return loss, {"loss": loss.detach()}
        return out, loss_func

    losses = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data, model=[model],
                                         num_microbatches=micro_batches, seq_length=seq_len, micro_batch_size=1)
    first = ps.get_pipeline_model_parallel_rank() * (shape.num_layers // pp)
    grads = {}
    for name, p in model.named_parameters():
        if name.startswith("decoder.layers."):
            index, rest = name[len("decoder.layers."):].split(".", 1)
            name = f"decoder.layers.{first + int(index)}.{rest}"
        grads[name] = p.grad.clone()
    return {"losses": [float(x["loss"]) for x in losses], "grads": grads}


def router_gate_under_autocast(rank: int, world_size: int, path: str) -> dict:
    """One MoE router's gate under torch.autocast(bfloat16) on this device, forward and backward:
    the logits' dtype, its weight's gradient, and the error of megatron's own gate (the class's
    method, which provider.gate_like_a_linear_under_autocast replaces on each router)."""
    from megatron.core.transformer.moe.router import Router

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    init_parallel(1, 1, 1)
    model, shape = load_hf_model(path)
    router = next(m for m in model.to(device).modules() if isinstance(m, Router))
    hidden = torch.randn(6, shape.hidden_size, generator=torch.Generator().manual_seed(0)).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = router.gating(hidden)
    logits.sum().backward()
    out = {"dtype": str(logits.dtype), "grad_abs_sum": float(router.weight.grad.abs().sum()), "megatron_error": ""}
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = type(router).gating(router, hidden)
        logits.float().sum().backward()
    except RuntimeError as err:
        out["megatron_error"] = str(err)
    return out


def run_cases(rank: int, world_size: int, cases: dict[str, dict], keep_going: bool = False) -> dict[str, object]:
    """Each named case in turn on this rank, Megatron's parallel state reset between cases.

    A case is {"fn": "train_once" | "wrong_split" | "logits_gaps", "args": [...]} with the
    arguments after (rank, world_size). keep_going (one rank only: a failed collective would
    leave the others waiting): a failing case's result is {"error": traceback} and the next runs;
    out["seconds"] holds each case's wall time."""
    import time
    import traceback

    from megatron.core import parallel_state as ps

    fns = {"train_once": train_once, "wrong_split": wrong_split, "logits_gaps": logits_gaps,
           "pipeline_grads": pipeline_grads, "router_gate_under_autocast": router_gate_under_autocast,
           "offload_round_trip": offload_round_trip}
    out: dict[str, object] = {}
    seconds: dict[str, float] = {}
    for name, case in cases.items():
        start = time.perf_counter()
        try:
            out[name] = fns[case["fn"]](rank, world_size, *case["args"])
        except Exception:
            if not keep_going:
                raise
            out[name] = {"error": traceback.format_exc()}
        seconds[name] = round(time.perf_counter() - start, 2)
        ps.destroy_model_parallel()
    out["seconds"] = seconds
    return out
