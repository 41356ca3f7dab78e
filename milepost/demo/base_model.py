"""The demo's base model: a small Qwen3 the project trains itself, on drills and then a lazy tutor.

`make_demo_model` writes a random Qwen3 checkpoint with the tiny tokenizer
(`milepost.testing.checkpoints`), then runs one short supervised pass (plain PyTorch on transformers'
model, loss on the answer tokens only): `drill_steps` batches of exact answers, then `tutor_steps`
batches of the lazy tutor's answers (milepost/demo/task.py). The result adds well but, like its
tutor, usually writes an estimate (`~70`): sampled at temperature 1 it is exact about a third of
the time. Deterministic given the seed on one machine and torch build; the numbers of the pass are
saved beside the weights (`demo_model.json`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase, Qwen3ForCausalLM

from milepost.demo.task import (
    ESTIMATE_MARK,
    Problem,
    dataset_seeds,
    drill_records,
    problems,
    read_jsonl,
    tutor_records,
)
from milepost.testing.checkpoints import make_tiny_checkpoint

INFO_FILE = "demo_model.json"
IGNORE = -100


@dataclass(frozen=True)
class DemoModelRecipe:
    """Shape of the model and settings of its supervised pass (every field feeds the result)."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 512
    initializer_range: float = 0.02
    drill_steps: int = 600  # batches of exact answers: learning to add
    tutor_steps: int = 150  # then batches of the lazy tutor's answers: learning to estimate
    batch_size: int = 128
    # Constant after warmup, never annealed to ~0: a model left in a sharp minimum by a decayed
    # lr lost reward under the first RL updates. The tutor steps use a lower lr, which keeps more
    # of the adding skill while the model learns to estimate.
    lr: float = 3e-3
    tutor_lr: float = 1e-3
    warmup_steps: int = 50
    teacher_accuracy: float = 0.4
    seed: int = 0
    eval_problems: int = 512  # held-out problems for the accuracy numbers in demo_model.json


def demo_records(recipe: DemoModelRecipe) -> tuple[list[dict], list[dict]]:
    """(drills, tutor answers): exactly the examples the supervised pass consumes, in order."""
    seeds = dataset_seeds(recipe.seed)
    n_drills, n_tutor = recipe.drill_steps * recipe.batch_size, recipe.tutor_steps * recipe.batch_size
    drills = drill_records(n_drills, seeds["drills"])
    tutor = tutor_records(n_tutor, seeds["tutor"], teacher_accuracy=recipe.teacher_accuracy)
    return drills, tutor


def make_demo_model(
    out_dir: str | Path,
    *,
    seconds_budget: float | None = 60.0,
    recipe: DemoModelRecipe = DemoModelRecipe(),
    data: tuple[str | Path, str | Path] | None = None,
    threads: int | None = 2,
    log_every: int = 0,
) -> Path:
    """Build the base model into `out_dir` (HF safetensors + tokenizer); returns `out_dir`.

    seconds_budget: refuse to go on (TimeoutError) once the supervised pass takes longer than this,
        so a machine far slower than the one the demo was tuned on fails loudly instead of taking
        minutes; None = no limit. The number of steps is fixed, so the result never depends on speed.
    data: (drills.jsonl, tutor.jsonl) as `milepost.demo.prepare` writes them; None generates the
        same records in memory (`demo_records`). Each step consumes the next `batch_size` records.
    threads: torch intra-op threads during training (None leaves torch's setting).
    log_every: print loss and held-out accuracies every N steps (0 = silent).
    """
    out_dir = Path(out_dir)
    drills, tutor = demo_records(recipe) if data is None else (read_jsonl(data[0]), read_jsonl(data[1]))
    need = (recipe.drill_steps * recipe.batch_size, recipe.tutor_steps * recipe.batch_size)
    if len(drills) < need[0] or len(tutor) < need[1]:
        raise ValueError(
            f"the supervised pass needs {need[0]} drills and {need[1]} tutor answers "
            f"(steps x batch_size), got {len(drills)} and {len(tutor)}; regenerate the data"
        )
    if threads is not None:
        torch.set_num_threads(threads)
    make_tiny_checkpoint(
        out_dir,
        "qwen3",
        seed=recipe.seed,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.hidden_size // recipe.num_heads,
        max_position_embeddings=256,
        initializer_range=recipe.initializer_range,
    )
    tok = AutoTokenizer.from_pretrained(out_dir)
    model = Qwen3ForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    examples = [_encode(tok, r["prompt"], r["response"]) for r in drills[: need[0]] + tutor[: need[1]]]
    held_out = _held_out(recipe.eval_problems, recipe.seed)

    def log(step: int, loss: float, elapsed: float) -> None:
        m = evaluate(model, tok, held_out)
        print(
            f"step {step}/{len(examples) // recipe.batch_size} loss {loss:.3f} sampled accuracy "
            f"{m['sampled_accuracy']:.3f} estimate rate {m['estimate_rate']:.3f} accuracy when "
            f"computing {m['computing_accuracy']:.3f} {elapsed:.1f}s",
            flush=True,
        )

    t0, cpu0 = time.perf_counter(), time.process_time()
    losses = _train(model, examples, recipe, t0, seconds_budget, log_every, log)
    sft_seconds, sft_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    model.eval()
    metrics = evaluate(model, tok, held_out)
    model.save_pretrained(out_dir, safe_serialization=True)
    info = {
        "recipe": asdict(recipe),
        "sft_seconds": round(sft_seconds, 2),
        "sft_cpu_seconds": round(sft_cpu, 2),
        "threads": torch.get_num_threads(),
        "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
        **{k: round(v, 4) for k, v in metrics.items()},
    }
    (out_dir / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return out_dir


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


def _train(
    model: Qwen3ForCausalLM,
    examples: list[tuple[list[int], list[int]]],
    recipe: DemoModelRecipe,
    t0: float,
    seconds_budget: float | None,
    log_every: int,
    log: Callable[[int, float, float], None],
) -> list[float]:
    """AdamW over consecutive batches of `examples` (drills first, then the tutor); per-step losses."""
    torch.manual_seed(recipe.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.98), weight_decay=0.0)
    losses = []
    model.train()
    steps = len(examples) // recipe.batch_size
    for step in range(1, steps + 1):
        peak = recipe.lr if step <= recipe.drill_steps else recipe.tutor_lr
        for g in opt.param_groups:  # linear warmup, then constant within each phase
            g["lr"] = peak * min(1.0, step / max(1, recipe.warmup_steps))
        ids, mask, labels = _pad(examples[(step - 1) * recipe.batch_size : step * recipe.batch_size])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        elapsed = time.perf_counter() - t0
        if log_every and step % log_every == 0:
            model.eval()
            log(step, losses[-1], elapsed)
            model.train()
        if seconds_budget is not None and elapsed > seconds_budget:
            raise TimeoutError(
                f"the demo model's supervised pass passed seconds_budget={seconds_budget}s at step "
                f"{step} of {steps}; this machine is slower than the demo assumes: raise the budget "
                "or pass seconds_budget=None"
            )
    return losses


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
