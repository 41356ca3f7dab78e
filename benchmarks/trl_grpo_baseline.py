"""TRL's `GRPOTrainer` on the workload of benchmarks/rl_step_gpu.py: the RL step's baseline.

Same model shape (Qwen3-0.6B, random weights, the same tiny-checkpoint builder and tokenizer),
8 prompts x 8 samples per step, 128-token prompts, 256 new tokens, temperature 1, bf16 on CUDA,
no vLLM (transformers `generate`), no reference model (beta 0, as milepost's default), one
optimizer step per generation batch. Prints every step's wall time and the median over steps
2..N (step 1 warms up); `--json-out` writes them. TRL is not a project dependency: on the H200
machine carry it as wheels (trl, datasets, dill, multiprocess; see benchmarks/RESULTS.md).
    python benchmarks/trl_grpo_baseline.py [--steps 8] [--json-out trl.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rl_step_gpu import QWEN3_06B, prompts  # the same prompts as milepost's run


def parity_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """1 when the completion has an even number of characters: any cheap reward will do here."""
    return [float(len(str(c)) % 2 == 0) for c in completions]


def run(steps: int, model_kwargs: dict, n_prompts: int, group: int, prompt_len: int, new_tokens: int) -> list[float]:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from milepost.testing.checkpoints import make_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="trl-grpo-"))
    model = make_tiny_checkpoint(work / "model", "qwen3", **model_kwargs)
    tok = AutoTokenizer.from_pretrained(model)
    data = Dataset.from_list([{"prompt": p} for p in prompts(tok, n_prompts * steps, prompt_len, 0)])
    cuda = torch.cuda.is_available()
    config = GRPOConfig(
        output_dir=str(work / "out"), per_device_train_batch_size=n_prompts * group, num_generations=group,
        max_completion_length=new_tokens, temperature=1.0, learning_rate=1e-6, beta=0.0, max_steps=steps,
        bf16=cuda, use_cpu=not cuda, use_vllm=False, logging_steps=1, report_to="none", save_strategy="no",
        dataloader_num_workers=0, seed=0,
    )
    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)

    trainer = GRPOTrainer(model=str(model), reward_funcs=parity_reward, args=config, train_dataset=data,
                          processing_class=tok, callbacks=[StepTimer()])
    trainer.train()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--tiny", action="store_true", help="a tiny Qwen3 instead of the 0.6B shape (CPU check)")
    p.add_argument("--json-out", type=Path)
    a = p.parse_args()
    if a.steps < 2:
        p.error("--steps must be >= 2 (step 1 is the warm-up)")
    shape = {"vocab_size": 512} if a.tiny else QWEN3_06B
    times = run(a.steps, shape, a.prompts, a.group, a.prompt_len, a.new_tokens)
    median = statistics.median(times[1:])
    print("step  seconds")
    for i, t in enumerate(times, start=1):
        print(f"{i:4d}  {t:.3f}")
    print(f"TRL GRPOTrainer: median step {median:.3f} s over steps 2..{len(times)}")
    if a.json_out:
        a.json_out.write_text(json.dumps({"step_times": times, "median_s": median}) + "\n")


if __name__ == "__main__":
    main()
