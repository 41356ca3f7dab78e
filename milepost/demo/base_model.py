"""The demo's base model: a small Qwen3 the project trains itself, on drills and then a lazy tutor.

`make_demo_model` writes a Qwen3 checkpoint with the tiny tokenizer, initialized from the seed by
our own code (not transformers' `_init_weights`, which changes between versions), then runs a
supervised pass in two phases, each steered by held-out measurements instead of a fixed number of
steps: drills (exact answers) until the model adds (`drill_target`), then the lazy tutor
(milepost/demo/task.py) until sampled exact-rate lies in `exact_band` while the model stays
right when it computes (`min_computing_accuracy`). Learning to add is a sudden transition
(carrying into the first digit) whose step varies with torch build and seed, so a fixed step count
landed on either side of it; a phase that misses its target by its cap raises `DemoModelError`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase, Qwen3ForCausalLM

from milepost.demo.recipe import DemoModelError, DemoModelRecipe
from milepost.demo.task import ESTIMATE_MARK, Problem, dataset_seeds, problems, tutor_stream
from milepost.testing.checkpoints import make_tiny_checkpoint

INFO_FILE = "demo_model.json"
IGNORE = -100


def batches(recipe: DemoModelRecipe, phase: str) -> Iterator[list[dict]]:
    """The records of each step of `phase` ("drills" | "tutor"), in order: a pure function of the seed."""
    seed = dataset_seeds(recipe.seed)[phase]
    stream = (({"prompt": p.prompt, "response": p.answer} for p in problems(seed)) if phase == "drills"
              else tutor_stream(seed, teacher_accuracy=recipe.teacher_accuracy))
    while True:
        yield [next(stream) for _ in range(recipe.batch_size)]


def make_demo_model(
    out_dir: str | Path,
    *,
    seconds_budget: float | None = None,
    recipe: DemoModelRecipe = DemoModelRecipe(),
    threads: int | None = 2,
    log_every: int = 0,
) -> Path:
    """Build the base model into `out_dir` (HF safetensors + tokenizer); returns `out_dir`.

    seconds_budget: refuse to go on (TimeoutError) once the supervised pass takes longer than this;
        None = no limit. Phases end on held-out measurements, never on time.
    threads: torch intra-op threads during training (None leaves torch's setting).
    log_every: print every held-out check whose step is a multiple of N (0 = silent).
    Raises DemoModelError if a phase misses its target by its cap (the message says which).
    """
    out_dir = Path(out_dir)
    if threads is not None:
        torch.set_num_threads(threads)
    make_tiny_checkpoint(
        out_dir, "qwen3", seed=recipe.seed, hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.hidden_size // recipe.num_heads, max_position_embeddings=256,
        initializer_range=recipe.initializer_range,
    )
    tok = AutoTokenizer.from_pretrained(out_dir)
    model = Qwen3ForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    _init_weights(model, recipe)
    held_out = _held_out(recipe.eval_problems, recipe.seed)
    t0, cpu0 = time.perf_counter(), time.process_time()
    trainer = _Trainer(model, tok, held_out, recipe, t0, seconds_budget, log_every)
    drills = trainer.phase("drills", recipe.lr, recipe.warmup_steps, 1, recipe.max_drill_steps,
                           lambda m: m["sampled_accuracy"] >= recipe.drill_target)
    lo, hi = recipe.exact_band
    tutor = trainer.phase("tutor", recipe.tutor_lr, recipe.tutor_warmup_steps, recipe.min_tutor_steps,
                          recipe.max_tutor_steps, lambda m: lo <= m["sampled_accuracy"] <= hi
                          and m["computing_accuracy"] >= recipe.min_computing_accuracy)
    sft_seconds, sft_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    model.eval()
    metrics = evaluate(model, tok, held_out)
    model.save_pretrained(out_dir, safe_serialization=True)
    info = {
        "recipe": asdict(recipe),
        "drill_steps": drills, "tutor_steps": tutor,
        "sft_seconds": round(sft_seconds, 2), "sft_cpu_seconds": round(sft_cpu, 2),
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "final_loss": round(sum(trainer.losses[-20:]) / len(trainer.losses[-20:]), 4),
        **{k: round(v, 4) for k, v in metrics.items()},
        "checks": trainer.checks,
    }
    (out_dir / INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
    return out_dir


@torch.no_grad()
def _init_weights(model: Qwen3ForCausalLM, recipe: DemoModelRecipe) -> None:
    """Normal(0, initializer_range) for every matrix, 1 for norms, drawn from one generator in name
    order: the same start on every transformers version (their init functions differ)."""
    gen = torch.Generator().manual_seed(recipe.seed)
    for name, p in sorted(model.named_parameters()):
        if p.ndim == 1:  # RMSNorm weights (Qwen3 has no biases)
            p.fill_(1.0)
        else:
            p.copy_(torch.empty(p.shape).normal_(0.0, recipe.initializer_range, generator=gen))


class _Trainer:
    """AdamW over the phases' batches, with the held-out checks that end each phase."""

    def __init__(self, model: Qwen3ForCausalLM, tok: PreTrainedTokenizerBase, held_out: list[Problem],
                 recipe: DemoModelRecipe, t0: float, seconds_budget: float | None, log_every: int) -> None:
        self.model, self.tok, self.held_out, self.recipe = model, tok, held_out, recipe
        self.t0, self.seconds_budget, self.log_every = t0, seconds_budget, log_every
        torch.manual_seed(recipe.seed)
        self.opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.98), weight_decay=0.0)
        self.losses: list[float] = []
        self.checks: list[dict] = []

    def phase(self, name: str, lr: float, warmup: int, min_steps: int, max_steps: int,
              done: Callable[[dict], bool]) -> int:
        """Train on `name`'s batches until a check satisfies `done` (after min_steps); steps run."""
        data = batches(self.recipe, name)
        for step in range(1, max_steps + 1):
            self._step(next(data), lr * min(1.0, step / max(1, warmup)))
            if step % self.recipe.check_every == 0 or step == max_steps:
                m = self._check(name, step)
                if step >= min_steps and done(m):
                    return step
        last = self.checks[-1]
        raise DemoModelError(
            f"the demo model's {name} phase missed its target in max_{name.rstrip('s')}_steps="
            f"{max_steps} steps (last held-out check: sampled accuracy {last['sampled_accuracy']}, "
            f"estimate rate {last['estimate_rate']}, right when computing {last['computing_accuracy']}; "
            f"targets: drill_target={self.recipe.drill_target}, exact_band={self.recipe.exact_band}, "
            f"min_computing_accuracy={self.recipe.min_computing_accuracy}); raise the cap or try "
            "another --seed, and report the torch version if the default recipe fails"
        )

    def _step(self, records: list[dict], lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr
        ids, mask, labels = _pad([_encode(self.tok, r["prompt"], r["response"]) for r in records])
        self.model.train()
        loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.losses.append(loss.item())
        elapsed = time.perf_counter() - self.t0
        if self.seconds_budget is not None and elapsed > self.seconds_budget:
            raise TimeoutError(
                f"the demo model's supervised pass passed seconds_budget={self.seconds_budget}s at "
                f"step {len(self.losses)}; this machine is slower than the demo assumes: raise the "
                "budget (--seconds-budget) or pass 0 for no limit"
            )

    def _check(self, phase: str, step: int) -> dict:
        self.model.eval()
        m = {"phase": phase, "step": step, "loss": round(self.losses[-1], 4),
             **{k: round(v, 4) for k, v in evaluate(self.model, self.tok, self.held_out).items()}}
        self.checks.append(m)
        if self.log_every and step % self.log_every == 0:
            print(f"{phase} step {step} loss {m['loss']:.3f} sampled accuracy {m['sampled_accuracy']:.3f} "
                  f"estimate rate {m['estimate_rate']:.3f} right when computing "
                  f"{m['computing_accuracy']:.3f} {time.perf_counter() - self.t0:.1f}s", flush=True)
        return m


def _encode(tok: PreTrainedTokenizerBase, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids + EOS): the plain-text prompt as the engine tokenizes it."""
    return (
        tok.encode(prompt, add_special_tokens=False),
        tok.encode(response, add_special_tokens=False) + [tok.eos_token_id],
    )


def _pad(examples: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and labels (IGNORE outside the answer): all [B, T]."""
    width = max(len(p) + len(a) for p, a in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, IGNORE)
    for i, (p, a) in enumerate(examples):
        n = len(p) + len(a)
        ids[i, :n] = torch.tensor(p + a)
        mask[i, :n] = 1
        labels[i, len(p) : n] = torch.tensor(a)
    return ids, mask, labels


def _held_out(n: int, seed: int) -> list[Problem]:
    stream = problems(dataset_seeds(seed)["held_out"])  # neither RL prompts nor training data
    return [p for p, _ in zip(stream, range(n))]


@torch.no_grad()
def evaluate(model: Qwen3ForCausalLM, tok: PreTrainedTokenizerBase, items: list[Problem]) -> dict[str, float]:
    """Exact accuracies on `items` without sampling, from one teacher-forced forward pass.

    sampled_accuracy: mean probability of the answer tokens (+ EOS) at temperature 1, i.e. the
        expected reward of one sample (the reward also accepts rare spellings such as " 68").
    greedy_accuracy: share of problems whose greedy decoding is exactly the answer.
    estimate_rate: mean probability that the answer starts with ESTIMATE_MARK.
    computing_accuracy: mean of sampled accuracy / (1 - estimate rate): how often the model is
        right when it does not estimate.
    """
    examples = [_encode(tok, p.prompt, p.answer) for p in items]
    ids, mask, labels = _pad(examples)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()  # [B, T-1, V]
    target = labels[:, 1:]
    on = target != IGNORE
    logprobs = torch.log_softmax(logits, -1)
    logp = logprobs.gather(-1, target.clamp(min=0)[..., None])[..., 0]
    p_right = (logp * on).sum(1).exp()  # [B]
    first = on.float().argmax(1)  # the position that predicts the first answer token
    (mark,) = tok.encode(ESTIMATE_MARK, add_special_tokens=False)
    p_estimate = logprobs[torch.arange(len(items)), first, mark].exp()  # [B]
    greedy = ((logits.argmax(-1) == target) | ~on).all(1).float().mean().item()
    return {
        "sampled_accuracy": p_right.mean().item(),
        "greedy_accuracy": greedy,
        "estimate_rate": p_estimate.mean().item(),
        "computing_accuracy": (p_right / (1 - p_estimate).clamp(min=1e-6)).mean().item(),
    }
