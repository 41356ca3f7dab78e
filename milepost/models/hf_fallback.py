"""The transformers fallback: any `AutoModelForCausalLM` driven through milepost's `CausalLM` contract.

transformers' own modules compute everything but attention, which is registered in its attention
interface under the name "milepost" and delegates to the forward's backend (paged KV in the
engine, packed varlen in the trainer; sliding windows, soft-capping and sinks through
masked_attention.py). Sequences are flattened into one row (`[1, T]`, positions per token), so
continuous batching, the radix prefix cache and packed training work unchanged. `compute_logits`
runs the model's own head code (lm_head plus any soft-capping or scaling) on given hidden states.
The cost against native models: no fused projections, no Triton norms, no CUDA graphs.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast

from milepost.models.base import ForwardContext
from milepost.models.masked_attention import Variant, attend_variant

ATTENTION_NAME = "milepost"
# Layer kinds the paged KV cache represents exactly; anything else (linear attention, mamba,
# chunked attention) carries state the cache has no room for.
SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


@dataclass
class _Holder:
    """Per-forward state the attention function reads (set on every module of the model)."""

    ctx: ForwardContext | None = None
    layers_seen: list[int] = field(default_factory=list)
    passthrough: torch.Tensor | None = None  # hidden states compute_logits hands the head


def _attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
    sliding_window: int | None = None, softcap: float | None = None, s_aux: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [1, H, T, D], key/value [1, Hkv, T, D]
    (RoPE applied) -> ([1, T, H, D], None)."""
    holder: _Holder | None = getattr(module, "_milepost_holder", None)
    if holder is None or holder.ctx is None:
        raise RuntimeError(f"{type(module).__name__} ran milepost attention outside HFCausalLM.forward")
    layer = int(module.layer_idx)
    holder.layers_seen.append(layer)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, D]
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    var = Variant(window=sliding_window, softcap=softcap, sinks=s_aux)
    if var.plain:
        out = holder.ctx.attention.attend(layer, q, k, v, scaling)
    else:
        out = attend_variant(holder.ctx.attention, layer, q, k, v, scaling, var)
    return out[None], None


def register_attention() -> None:
    """Make "milepost" a valid `attn_implementation` (idempotent). No mask function is registered:
    transformers then builds no mask, and the backend masks by sequence layout itself."""
    from transformers import AttentionInterface

    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, _attention)


def unsupported_reason(config: Any, model_cls: type | None = None) -> str | None:
    """Why the fallback cannot run this config exactly (naming the field), or None."""
    kinds = set(getattr(config, "layer_types", None) or []) - SUPPORTED_LAYER_TYPES
    if kinds:
        return (f"config.layer_types has {sorted(kinds)}: layers with recurrent or chunked state, which "
                "the paged KV cache cannot hold")
    if getattr(config, "attention_chunk_size", None):
        return "config.attention_chunk_size is set (chunked attention is not implemented)"
    if getattr(config, "is_encoder_decoder", False):
        return "config.is_encoder_decoder is true (only decoder-only causal LMs are served)"
    if model_cls is not None and not getattr(model_cls, "_supports_attention_backend", False):
        return (f"{model_cls.__name__} does not route attention through transformers' attention interface "
                "(_supports_attention_backend is False), so its KV cannot be paged")
    return None


class HFCausalLM(nn.Module):
    """A transformers causal LM behind the `CausalLM` protocol (milepost/models/base.py).

    The HF model's children are this module's children, so parameter names are the Hugging Face
    names (what weight updates, export and checkpoints use). `model.layers` is the decoder's layer
    list, as on native models (the trainer shards per layer). Always in eval mode: no dropout.
    """

    native = False

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        config = hf.config
        if config._attn_implementation != ATTENTION_NAME:
            raise ValueError(f"load the model with attn_implementation={ATTENTION_NAME!r} (register_attention())")
        object.__setattr__(self, "_hf", hf)  # not a child: its children are registered below
        for name, child in hf.named_children():
            self._modules[name] = child  # direct: `model` is also a property of this class
        self.hf_config = config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.num_layers: int = text.num_hidden_layers
        heads = text.num_attention_heads
        self.num_kv_heads: int = getattr(text, "num_key_value_heads", None) or heads
        self.head_dim: int = getattr(text, "head_dim", None) or text.hidden_size // heads
        self.vocab_size: int = text.vocab_size
        self.moe_top_k: int = 0  # routing is not recorded on the fallback (no R3)
        self.tie_word_embeddings = bool(getattr(text, "tie_word_embeddings", False))
        self._holder = _Holder()
        for m in hf.modules():
            object.__setattr__(m, "_milepost_holder", self._holder)
        # Plain attributes, not children: both are already registered under their HF names.
        object.__setattr__(self, "_base", hf.base_model)
        object.__setattr__(self, "_layers", _decoder_layers(self._base, self.num_layers))
        base_forward = self._base.forward

        def forward_or_pass(*args: Any, **kwargs: Any) -> Any:
            # compute_logits: hand the head the given hidden states instead of running the body.
            if self._holder.passthrough is not None:
                return _Passthrough(last_hidden_state=self._holder.passthrough)
            return base_forward(*args, **kwargs)

        object.__setattr__(self._base, "forward", forward_or_pass)
        self._aliases = _parameter_aliases(self)
        hf.eval()
        self._probe()

    @torch.no_grad()
    def _probe(self) -> None:
        """One token through the model: every layer must attend through the interface once, and
        the K/V shapes it hands over size the paged cache (configs can carry unused head counts)."""
        shapes: set[tuple[int, ...]] = set()

        class Recorder:
            def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       scale: float) -> torch.Tensor:
                shapes.add((*k.shape[1:], *v.shape[1:]))
                return q.new_zeros(*q.shape[:2], v.shape[-1])  # attention output has v's head size

            def attend_variant(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               scale: float, var: object) -> torch.Tensor:
                return self.attend(layer_id, q, k, v, scale)

        device = next(self.parameters()).device
        one = torch.zeros(1, dtype=torch.int64, device=device)
        self.forward(one, one, ForwardContext(Recorder()))
        seen = sorted(shapes)  # (k heads, k dim, v heads, v dim) per distinct layer shape
        if len(seen) != 1 or seen[0][:2] != seen[0][2:]:
            raise ValueError(f"{type(self._hf).__name__}: K/V shapes (heads, head_dim, heads, head_dim) "
                             f"{seen}: the paged KV cache needs one shape for K and V in every layer")
        self.num_kv_heads, self.head_dim = seen[0][0], seen[0][1]

    @property
    def model(self) -> nn.Module:
        """`model.layers` is the decoder layer list (what the trainer wraps per layer)."""
        inner = self._modules.get("model")
        return inner if inner is not None and hasattr(inner, "layers") else _LayersView(self._layers)

    def train(self, mode: bool = True) -> HFCausalLM:
        return super().train(False)  # dropout and train-only branches stay off: log-probs are exact

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final hidden states [T, hidden]."""
        h = self._holder
        # ctx stays set after the forward: per-layer activation checkpointing re-runs the layers
        # (and so this attention) during the backward of this same forward.
        h.ctx, h.layers_seen = ctx, []
        out = self._base(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        if sorted(h.layers_seen) != list(range(self.num_layers)):
            raise RuntimeError(
                f"{type(self._hf).__name__}: attention ran for layers {sorted(h.layers_seen)}, expected each of "
                f"0..{self.num_layers - 1} once; this architecture cannot run on the fallback's paged KV"
            )
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] fp32, through the model's own head code."""
        self._holder.passthrough = hidden[None]
        try:
            logits = self._hf(use_cache=False, return_dict=True).logits
        finally:
            self._holder.passthrough = None
        return logits[0].float()

    # --- weights by Hugging Face name -------------------------------------------------------------

    def hf_weight_names(self) -> list[str]:
        return [name for name, _ in self.named_parameters()]

    def hf_tensors(self, param_name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [(param_name, full)]

    def weight_view(self, hf_name: str) -> torch.Tensor:
        canonical = self._aliases.get(hf_name)
        if canonical is None:
            close = difflib.get_close_matches(hf_name, list(self._aliases), n=3)
            raise KeyError(f"{hf_name!r} is not a weight of {type(self._hf).__name__} (transformers "
                           f"fallback); closest names: {close}")
        return self.get_parameter(canonical).detach()


class _Passthrough(BaseModelOutputWithPast):
    """The body's output as the head reads it; fields other models add (router_logits, ...) are None."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _LayersView:
    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers = layers


def _decoder_layers(base: nn.Module, n: int) -> nn.ModuleList:
    lists = [m for m in base.modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if not lists:
        raise ValueError(f"{type(base).__name__}: no list of {n} decoder layers found")
    return lists[0]


def _parameter_aliases(module: nn.Module) -> dict[str, str]:
    """Every name a parameter answers to (tied weights: both) -> its name in named_parameters()."""
    canonical = {id(p): name for name, p in module.named_parameters()}
    return {name: canonical[id(p)] for name, p in module.named_parameters(remove_duplicate=False)}


def load_fallback(
    path: str | Path, dtype: torch.dtype, device: torch.device | str, trust_remote_code: bool = False
) -> HFCausalLM:
    """transformers' model for the directory `path` (weights loaded, nothing missing) as an HFCausalLM."""
    from transformers import AutoConfig, AutoModelForCausalLM

    register_attention()
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    cls = _model_class(config, trust_remote_code)
    reason = unsupported_reason(config, cls)
    if reason is not None:
        raise ValueError(f"{path}: the transformers fallback cannot run this model: {reason}")
    hf, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=ATTENTION_NAME, trust_remote_code=trust_remote_code,
        output_loading_info=True,
    )
    missing = [n for n in info.get("missing_keys", []) if not n.endswith("inv_freq")]
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} weights of {type(hf).__name__}: "
                         f"{sorted(missing)[:10]}")
    if info.get("mismatched_keys"):
        raise ValueError(f"{path}: weights whose shape does not match config.json: {info['mismatched_keys'][:10]}")
    return HFCausalLM(hf.to(device))


def _model_class(config: Any, trust_remote_code: bool) -> type | None:
    """The class AutoModelForCausalLM builds for `config` (None for remote code: resolved at load)."""
    from transformers import AutoModelForCausalLM

    archs = getattr(config, "architectures", None) or []
    if getattr(config, "auto_map", None):
        if not trust_remote_code:
            raise ValueError(f"config.json has auto_map (custom modeling code, architectures {archs}); "
                             "it runs only with --trust-remote-code")
        return None
    mapping = AutoModelForCausalLM._model_mapping
    if type(config) not in mapping:
        raise ValueError(f"transformers has no causal LM for {type(config).__name__} (architectures "
                         f"{archs}); a model with custom code needs --trust-remote-code")
    cls = mapping[type(config)]
    if archs and archs[0] != cls.__name__:
        raise ValueError(f"config.architectures names {archs[0]} but model_type {config.model_type!r} "
                         f"builds {cls.__name__}; fix config.json")
    return cls
