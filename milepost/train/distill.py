"""On-policy distillation (report section 5.2): the teacher's per-token signal folded into advantages.

Per response token the signal is a reverse-KL estimate, `log pi_student(x_t) - log pi_teacher(x_t)`
(one sample), or, with top-K, the student-probability-weighted sum of that difference over a
candidate set per position. `opd_coef * signal` is subtracted from the advantages the configured
estimator produced, on loss tokens only: a dense per-token reward, not a loss term. Both log-probs
are fixed inputs (the student's from rollout, the teacher's from the teacher pass).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from milepost.types import Sample

TOPK_KEY = "opd_topk"  # Sample.metadata: {"student": [[lp]*k_t]*T, "teacher": [[lp]*k_t]*T}


class DistillError(ValueError):
    """A sample's teacher signal is missing or does not match its response (never trained on)."""


@dataclass
class DistillStats:
    """Per-batch numbers for `opd/*` metrics, over loss tokens."""

    reverse_kl_mean: float
    teacher_logprob_mean: float
    tokens: int

    def metrics(self) -> dict[str, float]:
        return {"reverse_kl_mean": self.reverse_kl_mean,
                "teacher_logprob_mean": self.teacher_logprob_mean}


def reverse_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """One-sample estimate per token: [T] student log-probs, [T] teacher log-probs -> [T]."""
    return student.double() - teacher.double()


def topk_reverse_kl(student: Sequence[Sequence[float]], teacher: Sequence[Sequence[float]]) -> torch.Tensor:
    """Top-K estimate per token: at position t, sum_k w_k (s_k - t_k) over the candidate set, with
    w = the student's probabilities renormalized over the set (they sum to 1). Rows may differ in
    length (an intersection of top-K sets); an empty row is refused. -> [T] float64."""
    if len(student) != len(teacher):
        raise DistillError(f"top-K rows: {len(student)} student vs {len(teacher)} teacher positions")
    out = torch.empty(len(student), dtype=torch.float64)
    for t, (s_row, t_row) in enumerate(zip(student, teacher)):
        if len(s_row) != len(t_row) or not s_row:
            raise DistillError(f"top-K position {t}: {len(s_row)} student vs {len(t_row)} teacher "
                               "candidates (need the same, at least one)")
        s = torch.tensor(s_row, dtype=torch.float64)
        w = torch.softmax(s, dim=0)  # = p_s(k) / sum over the set
        out[t] = (w * (s - torch.tensor(t_row, dtype=torch.float64))).sum()
    return out


def sample_signal(s: Sample, student: torch.Tensor | None = None) -> torch.Tensor:
    """The sample's per-token reverse-KL estimate [response_length] float64.

    student: the student's log-probs of the sampled tokens; default its rollout log-probs. With
    top-K data in `metadata["opd_topk"]` the top-K estimate is used instead."""
    n = s.response_length
    topk = s.metadata.get(TOPK_KEY)
    if topk is not None:
        est = topk_reverse_kl(topk["student"], topk["teacher"])
        if est.numel() != n:
            raise DistillError(f"sample (group {s.group_index}, index {s.index}): top-K signal for "
                               f"{est.numel()} positions, response has {n}")
        return est
    if s.teacher_logprobs is None:
        raise DistillError(f"sample (group {s.group_index}, index {s.index}) has no teacher log-probs; "
                           "the teacher pass did not score it")
    lp_student = torch.as_tensor(s.rollout_logprobs if student is None else student, dtype=torch.float64)
    lp_teacher = torch.as_tensor(s.teacher_logprobs, dtype=torch.float64)
    if lp_teacher.numel() != n or lp_student.numel() != n:
        raise DistillError(f"sample (group {s.group_index}, index {s.index}): {lp_teacher.numel()} teacher "
                           f"and {lp_student.numel()} student log-probs for {n} response tokens")
    return reverse_kl(lp_student, lp_teacher)


def apply_opd(advantages: Sequence[torch.Tensor], signals: Sequence[torch.Tensor],
              loss_masks: Sequence[torch.Tensor], coef: float) -> list[torch.Tensor]:
    """advantages - coef * signal, on loss tokens only (a masked token keeps its advantage).
    Each tensor [response_length]; returns fp32."""
    if not len(advantages) == len(signals) == len(loss_masks):
        raise DistillError(f"{len(advantages)} advantages, {len(signals)} signals, {len(loss_masks)} masks")
    out = []
    for a, sig, m in zip(advantages, signals, loss_masks):
        if not a.shape == sig.shape == m.shape:
            raise DistillError(f"advantage {tuple(a.shape)}, signal {tuple(sig.shape)} and mask "
                               f"{tuple(m.shape)} differ")
        out.append((a.double() - coef * sig.double() * (m.double() > 0)).float())
    return out


def distill_stats(samples: Sequence[Sample], signals: Sequence[torch.Tensor],
                  loss_masks: Sequence[torch.Tensor]) -> DistillStats:
    """Means over loss tokens of the signal and of the teacher's log-prob of the sampled token."""
    keep = [m > 0 for m in loss_masks]
    kl = torch.cat([sig[k] for sig, k in zip(signals, keep)]) if signals else torch.zeros(0)
    teacher = [torch.as_tensor(s.teacher_logprobs, dtype=torch.float64)[k]
               for s, k in zip(samples, keep) if s.teacher_logprobs is not None]
    tl = torch.cat(teacher) if teacher else torch.zeros(0, dtype=torch.float64)
    return DistillStats(
        reverse_kl_mean=float(kl.mean()) if kl.numel() else 0.0,
        teacher_logprob_mean=float(tl.mean()) if tl.numel() else 0.0,
        tokens=int(kl.numel()))
