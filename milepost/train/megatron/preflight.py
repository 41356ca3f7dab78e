"""Run-config checks of `--train-backend` and Megatron's parallel sizes, made when the config is built.

So a bad size, a missing megatron-core or a feature the Megatron backend lacks stops the run
before any process starts, naming the flag and the numbers (the backend checks again on create).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from milepost.train.megatron.parallel import ParallelSizes, validate_sizes
from milepost.train.megatron.shape import shape_of

SIZE_FLAGS = {"tensor_model_parallel_size": "--tensor-model-parallel-size",
              "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
              "context_parallel_size": "--context-parallel-size",
              "expert_model_parallel_size": "--expert-model-parallel-size"}

# Run-config settings the Megatron backend does not have yet, with the value that turns each off.
_NOT_YET = {"lora_rank": 0, "critic_lr": None, "true_on_policy": False,
            "opd_teacher_checkpoint": None, "stream_optimizer_state_to_disk": False, "compile_layers": False,
            "activation_checkpointing": "none", "offload_actor_for_critic": (None, False)}


def sizes_of(cfg: Any) -> ParallelSizes:
    return ParallelSizes(tp=cfg.tensor_model_parallel_size, pp=cfg.pipeline_model_parallel_size,
                         cp=cfg.context_parallel_size, ep=cfg.expert_model_parallel_size)


def check_train_backend(cfg: Any) -> None:
    """Raise ValueError (ImportError for a missing package) when the backend settings cannot run."""
    if cfg.train_backend != "megatron":
        set_sizes = [flag for name, flag in SIZE_FLAGS.items() if getattr(cfg, name) != 1]
        if set_sizes:
            raise ValueError(f"{', '.join(set_sizes)} need --train-backend megatron (the FSDP backend is data "
                             "parallel only)")
        if getattr(cfg, "use_distributed_optimizer", False):
            raise ValueError("--use-distributed-optimizer needs --train-backend megatron (FSDP already shards "
                             "the optimizer state over its ranks)")
        return
    from milepost.train.megatron.provider import require_megatron  # imports torch: a Megatron run's cost only

    try:
        require_megatron()
    except ImportError as err:  # a config error: reported with the other refusals
        raise ValueError(str(err)) from None
    for name, off in _NOT_YET.items():
        value = getattr(cfg, name, None)
        if value not in (off if isinstance(off, tuple) else (off,)):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {value} is not available with --train-backend megatron yet; "
                             "turn it off or use --train-backend fsdp")
    checkpoint = getattr(cfg, "hf_checkpoint", None)
    if checkpoint is None or not (Path(checkpoint) / "config.json").is_file():
        return  # the checkpoint's own validator names the problem
    shape = shape_of(json.loads((Path(checkpoint) / "config.json").read_text()))
    sizes = sizes_of(cfg)
    validate_sizes(shape, sizes, cfg.actor_num_gpus_per_node)
    if sizes.pp > 1 and getattr(cfg, "use_rollout_routing_replay", False):
        raise ValueError(f"--use-rollout-routing-replay with --pipeline-model-parallel-size {sizes.pp}: replaying "
                         "routes on pipeline stages is not wired yet; set --pipeline-model-parallel-size 1 or turn R3 off")
    if shape.is_moe and sizes.tp > 1 and getattr(cfg, "use_rollout_routing_replay", False):
        raise ValueError(f"--use-rollout-routing-replay with --tensor-model-parallel-size {sizes.tp} on a "
                         "mixture-of-experts model: replaying routes under sequence parallel is not wired yet; "
                         "use --expert-model-parallel-size without TP, or turn R3 off")
