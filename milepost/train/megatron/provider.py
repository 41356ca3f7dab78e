"""Build a megatron-core GPTModel (local layer spec) for a `ModelShape`, and load HF weights into it.

Local specs (torch layers) are used everywhere: Transformer Engine does not install on these
machines. Needs megatron-core (`pip install 'milepost[megatron]'`) and an initialized
`megatron.core.parallel_state` (see `init_parallel`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from milepost.train.megatron.convert import hf_to_megatron, shard
from milepost.train.megatron.cpu_shim import install_cpu_shim, tensors_stay_on_cpu
from milepost.train.megatron.shape import ModelShape, shape_of

INSTALL_HINT = "pip install 'milepost[megatron]' (megatron-core 0.16)"


def require_megatron(feature: str = "--train-backend megatron") -> None:
    """Refuse `feature` when megatron-core is not installed, naming the package and the install."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise ImportError(f"{feature} needs the package megatron-core, which is not installed: {INSTALL_HINT}")


def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, seed: int = 1234) -> None:
    """Megatron's process groups over the default group (idempotent for the same sizes)."""
    require_megatron()
    from megatron.core import parallel_state as ps

    install_cpu_shim()
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size(), ps.get_context_parallel_world_size())
        if have != (tp, pp, ep, cp):
            raise RuntimeError(f"Megatron parallel state already set to (tp, pp, ep, cp) = {have}, asked {(tp, pp, ep, cp)}")
        return
    ps.initialize_model_parallel(tp, pp, context_parallel_size=cp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=1)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        # attention forks megatron's CUDA RNG tracker even without dropout: its states must exist
        model_parallel_cuda_manual_seed(seed)


def transformer_config(shape: ModelShape, *, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1,
                       dtype: torch.dtype = torch.float32, routing_replay: bool = False) -> Any:
    """megatron's TransformerConfig for `shape`: no dropout, no bias, no fused kernels (CPU-safe)."""
    require_megatron()
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe: dict[str, Any] = {}
    if shape.is_moe:
        moe = {
            "num_moe_experts": shape.num_experts,
            "moe_router_topk": shape.moe_top_k,
            "moe_ffn_hidden_size": shape.moe_ffn_hidden_size,
            "moe_layer_freq": [int(x) for x in shape.moe_layers],
            # top-k of the logits then softmax over them = HF's softmax, top-k, renormalize
            "moe_router_pre_softmax": not shape.norm_topk_prob,
            "moe_router_load_balancing_type": "none",
            "moe_aux_loss_coeff": 0.0,
            "moe_token_dispatcher_type": "allgather",  # alltoall needs CUDA streams
            "moe_grouped_gemm": False,
            "moe_router_dtype": "fp32",
            "moe_enable_routing_replay": routing_replay,  # R3 (milepost/train/megatron/replay.py)
        }
    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        qk_layernorm=shape.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=not torch.cuda.is_available(),
        # The checkpoint overwrites the values, but megatron marks TP-sharded weights
        # (tensor_model_parallel) only while initializing them; the grad norm needs the marks.
        perform_initialization=True,
        params_dtype=torch.float32,  # fp32 master weights, like the FSDP backend
        bf16=False,  # compute dtype through torch.autocast (MegatronScorer); parameters stay fp32
        # activations between pipeline stages: the residual stream stays fp32 under autocast
        pipeline_dtype=torch.float32,
        calculate_per_token_loss=True,  # our loss is pre-divided by the global token count: no rescaling
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        # megatron trains MoE layers under TP only with sequence parallel (moe_layer.py refuses it
        # otherwise); dense models keep the full sequence on every TP rank
        sequence_parallel=tp > 1 and shape.is_moe,
        **moe,
    )
    # Packed micro-batches differ in length: pipeline stages send each activation's shape first.
    # Set after the checks: they refuse it with the allgather dispatcher, which is the default even
    # for dense models; MoE models pad a pipeline call's micro-batches to one length (pipeline.py).
    config.variable_seq_lengths = pp > 1 and not shape.is_moe
    return config


def build_model(shape: ModelShape, *, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1,
                dtype: torch.dtype = torch.float32, parallel_output: bool = False,
                routing_replay: bool = False) -> Any:
    """This rank's GPTModel (its pipeline stage, its experts, its TP slices); weights uninitialized."""
    require_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    install_cpu_shim()
    config = transformer_config(shape, tp=tp, pp=pp, ep=ep, cp=cp, dtype=dtype, routing_replay=routing_replay)
    if shape.is_moe:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        if config.sequence_parallel:
            spec = _swap_norms(copy.deepcopy(spec))
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=shape.qk_layernorm, normalization="RMSNorm")
    with tensors_stay_on_cpu():  # a tied embedding on the last pipeline stage calls .cuda()
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=shape.vocab_size,
            max_sequence_length=shape.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            parallel_output=parallel_output,
            share_embeddings_and_output_weights=shape.tied_embeddings,
            position_embedding_type="rope",
            rotary_base=int(shape.rope_theta) if float(shape.rope_theta).is_integer() else shape.rope_theta,
        )
    gate_like_a_linear_under_autocast(model)
    return model


def gate_like_a_linear_under_autocast(model: Any) -> None:
    """Give every MoE router of `model` a gate that trains under torch.autocast.

    megatron's gate is an autograd Function that casts to moe_router_dtype (fp32) in forward; under
    autocast its matmul still runs in bf16, and its backward then multiplies the bf16 gradient with
    the fp32 weight: RuntimeError (bf16 Qwen3-MoE on the H200, 2026-12-03). Under autocast the gate
    is a plain linear (autocast picks its dtype, as for every other linear here and for
    transformers' router), its logits fp32 for the routing; without autocast megatron's gate runs."""
    from megatron.core.transformer.moe.router import Router

    for module in model.modules():
        if isinstance(module, Router):
            module.gating = functools.partial(_gating, module, module.gating)


def _gating(router: Any, megatron_gating: Any, hidden: torch.Tensor) -> torch.Tensor:
    if torch.is_autocast_enabled(hidden.device.type):
        return F.linear(hidden, router.weight, router.bias).float()
    return megatron_gating(hidden)


class SequenceParallelRMSNorm:
    """megatron's local norm (WrappedTorchNorm, which refuses sequence parallel), allowed under it:
    RMSNorm is per token, so each TP rank normalizes its part of the sequence; the weight is marked
    `sequence_parallel` so its gradient is summed over TP (milepost/train/megatron/collectives.py sync_gradients), as
    megatron does for its Transformer Engine norms."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.RMSNorm:
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        norm.weight.sequence_parallel = bool(config.sequence_parallel)
        return norm


def _swap_norms(spec: Any) -> Any:
    """`spec` with every WrappedTorchNorm replaced by SequenceParallelRMSNorm (in place)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return SequenceParallelRMSNorm
    if isinstance(spec, ModuleSpec):
        spec.module = _swap_norms(spec.module)
        spec.submodules = _swap_norms(spec.submodules)
    elif isinstance(spec, list):
        return [_swap_norms(x) for x in spec]
    elif dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for field in dataclasses.fields(spec):
            setattr(spec, field.name, _swap_norms(getattr(spec, field.name)))
    return spec


def read_hf_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory's safetensors files (fp32 or as stored; an FP8
    blockwise checkpoint's float8 weights dequantized, as the FSDP trainer's loader does)."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files (the Megatron backend reads safetensors checkpoints)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    from milepost.lowprec.fp8_checkpoint import dequantize_state

    return dequantize_state(path, out)  # an FP8 checkpoint: float32 weights, scales applied


def load_hf_into(model: Any, shape: ModelShape, hf: dict[str, torch.Tensor]) -> None:
    """Copy HF weights into this rank's model (its shard of them); every parameter must be covered."""
    from megatron.core import parallel_state as ps

    full = hf_to_megatron(shape, hf)
    mine = shard(shape, full, tp=ps.get_tensor_model_parallel_world_size(),
                 pp=ps.get_pipeline_model_parallel_world_size(), ep=ps.get_expert_model_parallel_world_size(),
                 tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                 ep_rank=ps.get_expert_model_parallel_rank())
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(mine))
    extra = sorted(set(mine) - set(params))
    if missing or extra:
        raise ValueError(f"Megatron model and converted weights disagree: missing {missing[:5]}, extra {extra[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            if p.shape != mine[name].shape:
                raise ValueError(f"{name}: model shape {tuple(p.shape)}, converted {tuple(mine[name].shape)}")
            p.copy_(mine[name])


def load_hf_model(path: str | Path, *, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1,
                  dtype: torch.dtype = torch.float32) -> tuple[Any, ModelShape]:
    """Build this rank's GPTModel for the HF directory `path` and load its weights."""
    import json

    shape = shape_of(json.loads((Path(path) / "config.json").read_text()))
    model = build_model(shape, tp=tp, pp=pp, ep=ep, cp=cp, dtype=dtype)
    load_hf_into(model, shape, read_hf_weights(path))
    return model, shape
