"""MTP co-training (`--enable-mtp-training`, `--mtp-loss-scaling-factor`, Miles' and Megatron's
names): the checkpoint's multi-token-prediction layer learns, beside the policy loss, to predict
the rollout tokens the NEXTN draft will propose at generation time.

Inside the policy's forward (TokenScorer, so FSDP has the MTP layer's weights gathered), the MTP
layer runs over each packed sequence as the engine runs it: at position p it reads the policy's
final hidden state at p and the token at p + 1, and its cross-entropy on the token at p + 2 is
kept for every response row. Its inputs are detached and the shared embedding and LM head enter
as constants (Miles detaches the MTP heads the same way): the MTP loss trains the MTP layer only,
so the policy's gradient is the RL objective's alone. The loss is the loss-masked cross-entropy
sum times the scaling factor, divided by the step's loss-token count like the policy loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from milepost.models.attention import VarlenCausalAttention
from milepost.models.base import CausalLM, ForwardContext


@dataclass
class MtpOutput:
    """ce: [N] cross-entropy of each response row's token two ahead (0 where not valid);
    valid: [N] bool, rows whose MTP input lies inside their sequence; anchor: a zero that ties
    the MTP layer into the graph on every rank (an empty micro-batch still has gradients)."""

    ce: torch.Tensor
    valid: torch.Tensor
    anchor: torch.Tensor


def mtp_cross_entropy(lm: CausalLM, hidden: torch.Tensor, input_ids: torch.Tensor,
                      positions: torch.Tensor, cu_seqlens: torch.Tensor, rows: torch.Tensor,
                      targets: torch.Tensor, chunk_size: int = 1024) -> MtpOutput:
    """The MTP layer's cross-entropy at `rows` (packed rows r whose next token, targets, is a
    response token): row r's prediction comes from MTP position r - 1 (state at r - 1, token r).

    hidden: [T, H] the policy's final states; input_ids / positions: [T]; cu_seqlens: [B + 1]."""
    bounds = [int(x) for x in cu_seqlens.tolist()]
    keep = torch.cat([torch.arange(s, e - 1, device=hidden.device)
                      for s, e in zip(bounds, bounds[1:])])  # every position but each sequence's last
    lens = [e - s - 1 for s, e in zip(bounds, bounds[1:]) if e - s > 1]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.long)
    weight = lm.model.embed_tokens.weight.detach()  # shared with the policy: a constant here
    e = F.embedding(input_ids[keep + 1], weight)
    cos, sin = lm.rotary(positions[keep], e.dtype)
    ctx = ForwardContext(VarlenCausalAttention(cu))
    h = lm.mtp[0].predict(e, hidden[keep].detach(), cos, sin, ctx)  # [T - B, H]
    anchor = h.sum() * 0.0
    # MTP row of packed row r - 1: shifted down by the sequences before it (each lost its last row).
    seq = torch.searchsorted(cu_seqlens.to(rows.device), rows, right=True) - 1
    valid = rows - 1 >= cu_seqlens.to(rows.device)[seq]
    mtp_rows = (rows - 1 - seq).clamp(min=0)
    head = lm.lm_head.weight.detach()
    ces = []
    for r, t in zip(mtp_rows.split(chunk_size), targets.split(chunk_size)):
        logits = F.linear(h.index_select(0, r), head).float()
        ces.append(F.cross_entropy(logits, t, reduction="none"))
    ce = torch.cat(ces) if ces else h.new_zeros(0, dtype=torch.float32)
    return MtpOutput(torch.where(valid, ce, torch.zeros_like(ce)), valid, anchor)


def mtp_loss(out: MtpOutput, loss_mask: torch.Tensor, loss_tokens: float, scale: float,
             acc: torch.Tensor) -> torch.Tensor:
    """scale * sum(ce over loss-masked valid rows) / loss_tokens; acc [2] += (ce sum, rows)."""
    if loss_mask.shape != out.ce.shape:  # an empty micro-batch (dummy rows): nothing to learn
        return out.anchor
    w = loss_mask * out.valid
    total = (out.ce * w).sum()
    acc += torch.stack([total.detach(), w.sum()]).double()
    return total * (scale / max(loss_tokens, 1.0)) + out.anchor


def mtp_params(scorer: torch.nn.Module, mtp: bool) -> list[torch.nn.Parameter]:
    """The policy's MTP-layer parameters (mtp=True) or all others (for separate clipping)."""
    inside = {id(p) for p in getattr(scorer.lm, "mtp", torch.nn.ModuleList()).parameters()}
    return [p for p in scorer.parameters() if (id(p) in inside) == mtp]
