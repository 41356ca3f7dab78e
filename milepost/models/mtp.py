"""Multi-token prediction (MTP) layers of DeepSeek-V3 style checkpoints, the engine's NEXTN draft.

A checkpoint with `num_nextn_predict_layers = n` stores n extra layers after the decoder's, as
`model.layers.{num_hidden_layers + i}.*`: `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and one
decoder layer (`input_layernorm`, `self_attn.*`, `post_attention_layernorm`, `mlp.*`). Layer i
at position p reads the target's final hidden state at p (or the previous MTP step's output) and
the embedding of token p + 1, and predicts token p + 2:
`h' = shared_head.norm(layer(eh_proj([enorm(embed(x_{p+1})), hnorm(h_p)])))`, logits = lm_head(h').
The embedding and the LM head are the target's (DeepSeek's checkpoints also keep copies of them
under the MTP layer as `embed_tokens` / `shared_head.head`: read, never used, as SGLang does).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from torch import nn

from milepost.models.base import ForwardContext
from milepost.models.layers import DecoderLayer, RMSNorm

# Copies of the target's tensors a DeepSeek checkpoint stores under each MTP layer.
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


class MtpLayer(DecoderLayer):
    """One MTP module: the fusion of token embedding and hidden state, a decoder layer, a norm.

    The decoder layer's modules sit directly on this one (`self_attn`, `mlp`, the two norms), as
    the checkpoint names them; `self_attn` is set by the model (MLA for DeepSeek-V3)."""

    def __init__(self, config: object, mlp: nn.Module) -> None:
        super().__init__(config, 0, False, mlp)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, eps)

    def predict(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """embeds: [T, H] of tokens p + 1, hidden: [T, H] states at p -> [T, H] normed output
        (the LM head's input, and the next chained step's `hidden`)."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.shared_head.norm(DecoderLayer.forward(self, x, cos, sin, ctx))


def mtp_layers_in_checkpoint(path: str | Path, config: object) -> int:
    """How many of the config's `num_nextn_predict_layers` the safetensors in `path` hold (0 when
    the config names none or the weights are absent: transformers' DeepseekV3Config defaults the
    count to 1 for checkpoints that have no MTP weights at all)."""
    wanted = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    if wanted <= 0:
        return 0
    first = int(config.num_hidden_layers)
    found: set[int] = set()
    for name in checkpoint_names(Path(path)):
        m = _LAYER.match(name)
        if m and first <= int(m.group(1)) < first + wanted:
            found.add(int(m.group(1)) - first)
    # Layers must come in order: a gap would leave an MTP module of random weights.
    n = 0
    while n in found:
        n += 1
    return n


def checkpoint_names(path: Path) -> list[str]:
    """Tensor names of a safetensors checkpoint (the index when there is one, else each shard)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text()).get("weight_map", {}))
    names: list[str] = []
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            names.extend(f.keys())
    return names


def is_mtp_copy(name: str, num_hidden_layers: int) -> bool:
    """A checkpoint's copy of the target's embedding or head under an MTP layer (not loaded)."""
    m = _LAYER.fullmatch(name)
    return bool(m) and int(m.group(1)) >= num_hidden_layers and m.group(2) in MTP_COPIES


def mtp_draft_globs(path: str | Path) -> list[str]:
    """Name globs of the MTP layers a checkpoint holds (`model.layers.{N + i}.*`), [] for none."""
    raw = json.loads((Path(path) / "config.json").read_text())
    n = raw.get("num_hidden_layers", 0)
    config = SimpleNamespace(num_hidden_layers=n, num_nextn_predict_layers=raw.get("num_nextn_predict_layers", 1))
    return [f"model.layers.{n + i}.*" for i in range(mtp_layers_in_checkpoint(path, config))]
