"""`milepost diagnose mismatch RUN_DIR`: where a run's train-rollout log-prob gap comes from.

For one saved rollout batch (--save-rollouts), the response tokens are re-scored along a chain
of computations from the engine's to the trainer's, changing one thing per link:
  saved        the log-probs the engine reported during the run
  decode       engine replay: paged KV, the prompt prefilled, then one decode row per token with
               every sequence in the batch, fused q/k/v and gate/up projections (run dtype)
  prefill      engine kernels, each whole sequence in one prefill chunk, batch as above
  trainer      the trainer's packed forward: every sequence in one varlen batch, unfused
  alone        the trainer's computation with each sequence alone (the --true-on-policy contract)
  fp32         the packed trainer forward in float32
Each link's mean |difference| per token says how much it moves the numbers: saved->decode is
weight staleness (or sampler-side changes: penalties, grammar), decode->prefill the attention
kernels, prefill->trainer the engine/trainer code paths, trainer->alone the batch composition,
trainer->fp32 the precision. By the triangle inequality the links bound |saved - trainer|.
The re-scoring runs on CPU with the torch reference kernels (the run's GPU kernels are not
replayed: see docs/true_on_policy.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import tomllib
import torch

from milepost.data.rollout_io import load_rollout
from milepost.models.attention import VarlenCausalAttention
from milepost.models.base import ForwardContext
from milepost.models.registry import load_model
from milepost.onpolicy.contract import sequence_logprobs
from milepost.testing.paged_run import paged_logits
from milepost.train.logprobs import pack, token_logprobs

LINKS = (
    ("saved", "decode", ("weights / sampler / engine batching (staleness, penalties, grammar, "
     "which requests shared each step)")),
    ("decode", "prefill", "kernels: engine decode vs engine prefill"),
    ("prefill", "trainer", "code path: engine (paged, fused projections) vs trainer (varlen)"),
    ("trainer", "alone", "batch composition: packed batch vs each sequence alone"),
    ("trainer", "fp32", "precision: run dtype vs float32"),
)


@dataclass
class Mismatch:
    tokens: int
    scores: dict[str, torch.Tensor]  # name -> [tokens] fp32, responses concatenated
    dtype: str

    def mean_abs(self, a: str, b: str) -> float:
        return float((self.scores[a] - self.scores[b]).abs().mean())

    def table(self) -> str:
        total = self.mean_abs("saved", "trainer")
        links = [(a, b, why, self.mean_abs(a, b)) for a, b, why in LINKS]
        chain = sum(d for a, _, _, d in links if a != "trainer") or 1.0
        lines = [(f"{self.tokens} response tokens, dtype {self.dtype}; "
                 f"|saved - trainer| = {total:.3g} per token (train_rollout_logprob_abs_diff)"),
                 f"{'link':<20} {'mean |diff|':>12} {'share':>7}  source"]
        for a, b, why, d in links:
            share = f"{100 * d / chain:6.1f}%" if a != "trainer" else "   n/a "
            lines.append(f"{a + ' -> ' + b:<20} {d:>12.3g} {share}  {why}")
        lines.append("share: of the chain saved -> decode -> prefill -> trainer (it bounds the total); "
                     "the last two links are what packing and precision add on their own")
        return "\n".join(lines)


def _run_settings(run_dir: Path) -> dict:
    path = run_dir / "config.resolved.toml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: RUN_DIR must be a `milepost train` run directory")
    flat: dict = {}
    for table in tomllib.loads(path.read_text()).values():
        if isinstance(table, dict):
            flat.update(table)
    return flat


def _packed_logprobs(lm, tokens: list[torch.Tensor], resp: list[int], temperature: float) -> torch.Tensor:
    batch = pack(tokens, resp, "cpu")
    with torch.no_grad():
        hidden = lm(batch.input_ids, batch.positions, ForwardContext(VarlenCausalAttention(batch.cu_seqlens)))
        logp, _ = token_logprobs(lm, hidden, batch.rows, batch.targets, temperature=temperature,
                                 use_checkpoint=False)
    return logp


def _paged_logprobs(lm, tokens: list[torch.Tensor], resp: list[int], first: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = paged_logits(lm, tokens, first)
    out = []
    for lg, t, r in zip(logits, tokens, resp):
        rows = torch.arange(len(t) - r - 1, len(t) - 1)
        lp = torch.log_softmax(lg[rows].float() / temperature, dim=-1)
        out.append(lp.gather(1, t[rows + 1][:, None])[:, 0])
    return torch.cat(out)


def diagnose(run_dir: str | Path, step: int = 0, model_path: str | Path | None = None,
             max_samples: int = 64) -> Mismatch:
    """Re-score step `step`'s saved rollout of `run_dir` along the chain (see the module doc).

    model_path: the weights that generated that rollout (default: the run's --hf-checkpoint, the
    weights of step 0; later steps need the checkpoint of their weight version).
    """
    run_dir = Path(run_dir)
    s = _run_settings(run_dir)
    if not s.get("save_rollouts"):
        raise ValueError(f"{run_dir} saved no rollouts: rerun with --save-rollouts DIR")
    groups = load_rollout(s["save_rollouts"], step)
    samples = [x for g in groups for x in g if x.rollout_logprobs and x.response_length > 0][:max_samples]
    if not samples:
        raise ValueError(f"step {step} of {run_dir} has no sample with rollout log-probs")
    temperature = float(s.get("rollout_temperature", 1.0)) or 1.0  # greedy is reported at T=1
    dtype = s.get("dtype", "float32")
    if dtype == "auto":
        dtype = "float32"
    path = Path(model_path or s["hf_checkpoint"])
    tokens = [torch.tensor(x.tokens, dtype=torch.int64) for x in samples]
    resp = [x.response_length for x in samples]
    prompts = [len(t) - r for t, r in zip(tokens, resp)]
    lm = load_model(path, getattr(torch, dtype), "cpu")
    scores = {"saved": torch.tensor([v for x in samples for v in x.rollout_logprobs], dtype=torch.float32)}
    scores["trainer"] = _packed_logprobs(lm, tokens, resp, temperature)
    scores["alone"] = torch.cat([sequence_logprobs(lm, t, r, temperature) for t, r in zip(tokens, resp)])
    if hasattr(lm, "fuse_projections"):
        lm.fuse_projections()  # as the engine serves it
    scores["decode"] = _paged_logprobs(lm, tokens, resp, prompts, temperature)
    scores["prefill"] = _paged_logprobs(lm, tokens, resp, [len(t) for t in tokens], temperature)
    scores["fp32"] = _packed_logprobs(load_model(path, torch.float32, "cpu"), tokens, resp, temperature)
    return Mismatch(int(scores["saved"].numel()), scores, dtype)
