"""A tiny tool-calling model for agentic tests: a random Qwen3 checkpoint with the tiny tokenizer,
taught in a few dozen supervised steps (no tool list in the prompt: short sequences) to answer "Weather in X?" with `<think>` reasoning and a
`<tool_call>` to `get_weather`, to answer the tool's result with reasoning and a sentence, and to
answer anything else briefly. Random weights never emit a parseable tool call; this one does, so
tests exercise real stop tokens and real tool-call parsing through the engine.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

from milepost.testing.checkpoints import make_tiny_checkpoint

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CITIES = ("Paris", "Oslo", "Rome", "Lima", "Cairo", "Tokyo", "Quito", "Bern")
CONDITIONS = ("sunny", "rain", "snow", "windy")


def weather_conversation(city: str, cond: str, call_id: str = "call_1") -> list[dict]:
    """The conversation the model is taught (and which agent tests replay)."""
    return [
        {"role": "user", "content": f"Weather in {city}?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
         "tool_calls": [{"id": call_id, "type": "function", "function": {
             "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
        {"role": "tool", "tool_call_id": call_id, "content": cond},
        {"role": "assistant", "content": f"It is {cond}.",
         "reasoning_content": "The tool answered."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You are welcome."},
    ]


def _examples(tok, n: int, seed: int, tools: list[dict] | None = None,
              ) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) with labels only on assistant turns (their end-of-turn token included)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        conv = weather_conversation(rng.choice(CITIES), rng.choice(CONDITIONS))
        ids: list[int] = []
        labels: list[int] = []
        done = 0
        for k, m in enumerate(conv):
            if m["role"] != "assistant":
                continue
            prompt = tok.apply_chat_template(conv[:k], tools=tools, tokenize=False,
                                             add_generation_prompt=True)
            full = tok.apply_chat_template(conv[:k + 1], tools=tools, tokenize=False)
            full = full[: full.rfind("<|im_end|>") + len("<|im_end|>")]
            p_ids = tok(prompt[done:], add_special_tokens=False)["input_ids"]
            a_ids = tok(full[len(prompt):], add_special_tokens=False)["input_ids"]
            ids += p_ids + a_ids
            labels += [-100] * len(p_ids) + a_ids
            done = len(full)
        out.append((ids, labels))
    return out


def make_agent_model(path: str | Path, steps: int = 60, seed: int = 0,
                     tools: list[dict] | None = None) -> Path:
    """Write the tool-calling checkpoint to `path` (skipped when it is there already); with
    `tools`, taught with that tool list in its prompts (as an OpenAI chat request renders it)."""
    path = Path(path)
    if (path / "agent_model.json").is_file():
        return path
    make_tiny_checkpoint(path, "qwen3", seed=seed, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16)
    tok = AutoTokenizer.from_pretrained(path)
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    torch.manual_seed(seed)
    final_loss = fit_examples(model, _examples(tok, 64, seed, tools), steps, seed)
    model.save_pretrained(path)
    (path / "agent_model.json").write_text(json.dumps({"steps": steps, "final_loss": final_loss}))
    return path


def fit_examples(model: Qwen3ForCausalLM, data: list[tuple[list[int], list[int]]], steps: int,
                 seed: int) -> float:
    """AdamW (lr 1e-2) over `steps` random batches of 8 (ids, labels) pairs; leaves the model in
    eval mode and returns the last batch's loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = random.Random(seed)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        batch = gen.sample(data, 8)
        width = max(len(i) for i, _ in batch)
        ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        attn = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in batch])
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return loss.item()
