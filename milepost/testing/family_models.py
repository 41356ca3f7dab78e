"""Tiny tool-calling checkpoints for the live family check (report 2.4.3) of families other than
qwen3: a random Qwen3-architecture model with the tiny tokenizer plus the family's special tokens,
taught in a few dozen supervised steps the weather conversation (milepost/testing/agent_model.py)
as the family's published template renders it (milepost/testing/chat_templates.py). The training
text is cut into the pieces the session server itself tokenizes (checks.incremental_text), with
labels on the assistant turns, so the model learns the family's real stop token and tool-call
format and a live session exercises both.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from transformers import Qwen3ForCausalLM

from milepost.session.checks import incremental_text
from milepost.session.families import get_family
from milepost.session.render import Renderer
from milepost.testing.agent_model import (
    CITIES,
    CONDITIONS,
    fit_examples,
    weather_conversation,
)
from milepost.testing.chat_templates import DEEPSEEK_V3, LLAMA3_2, QWEN2_5
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.family_chat_templates import (
    GLM4_5,
    GLM4_NOT_SPECIAL,
    GLM4_SPECIALS,
    GPT_OSS,
    GPT_OSS_SPECIALS,
    KIMI_K2,
    KIMI_K2_SPECIALS,
    MISTRAL_NEMO,
    MISTRAL_SPECIALS,
    MISTRAL_V3,
)
from milepost.testing.tokenizer import build_tiny_tokenizer

LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>")
DEEPSEEK_SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                     "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                     "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>",
                     "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
                     "<｜tool▁sep｜>")
# family -> (published template, special tokens to add, end-of-turn / eos, bos). A family that
# carries its own template (deepseek-v3) trains and serves with that one.
FAMILIES: dict[str, tuple[str, tuple[str, ...], str, str | None]] = {
    "qwen2.5": (QWEN2_5, (), "<|im_end|>", None),
    "llama3": (LLAMA3_2, LLAMA3_SPECIALS, "<|eot_id|>", "<|begin_of_text|>"),
    "deepseek-v3": (DEEPSEEK_V3, DEEPSEEK_SPECIALS, "<｜end▁of▁sentence｜>",
                    "<｜begin▁of▁sentence｜>"),
    "kimi-k2": (KIMI_K2, KIMI_K2_SPECIALS, "<|im_end|>", None),
    "mistral": (MISTRAL_V3, MISTRAL_SPECIALS, "</s>", "<s>"),
    "mistral-tekken": (MISTRAL_NEMO, MISTRAL_SPECIALS, "</s>", "<s>"),
    # GLM's checkpoints stop on <|endoftext|>, <|user|> and <|observation|> (config eos ids).
    "glm4": (GLM4_5, GLM4_SPECIALS, "<|endoftext|>", None),
    # gpt-oss stops on <|return|> and <|call|>; trains and serves with the family's template.
    "gpt-oss": (GPT_OSS, GPT_OSS_SPECIALS, "<|return|>", None),
}
NOT_SPECIAL = {"glm4": GLM4_NOT_SPECIAL}
# The tool-call ids each family's models write (Kimi K2 names the function in its ids; Mistral's
# templates want 9 alphanumeric characters).
CALL_IDS = {"kimi-k2": "functions.get_weather:0", "mistral": "a1b2c3d4e",
            "mistral-tekken": "a1b2c3d4e"}
BASE_VOCAB = 512


def family_tokenizer(family: str):
    template, specials, eos, bos = FAMILIES[family]
    tok = build_tiny_tokenizer(BASE_VOCAB)
    if specials:
        tok.add_special_tokens({"additional_special_tokens": list(specials)})
    tok.add_tokens([t for t in NOT_SPECIAL.get(family, ()) if t not in tok.get_vocab()])
    tok.eos_token = eos
    if bos is not None:
        tok.bos_token = bos
    tok.chat_template = template
    return tok


def _examples(renderer: Renderer, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    out = []
    call_id = CALL_IDS.get(renderer.family.name, "call_1")
    for _ in range(n):
        conv = weather_conversation(rng.choice(CITIES), rng.choice(CONDITIONS), call_id)
        ids: list[int] = []
        labels: list[int] = []
        for k, piece in enumerate(incremental_text(renderer, conv, None)):
            piece_ids = renderer.encode(piece)
            ids += piece_ids
            labels += piece_ids if k % 2 else [-100] * len(piece_ids)  # odd pieces: the model's
        out.append((ids, labels))
    return out


def make_family_agent_model(path: str | Path, family: str, steps: int = 60,
                            seed: int = 0) -> Path:
    """Write the family's tiny tool-calling checkpoint to `path` (skipped when it is there)."""
    path = Path(path)
    if (path / "family_model.json").is_file():
        return path
    tok = family_tokenizer(family)
    make_tiny_checkpoint(path, "qwen3", seed=seed, vocab_size=BASE_VOCAB + 16,
                         with_tokenizer=False, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16)
    tok.save_pretrained(path)
    renderer = Renderer(tok, get_family(family))
    if len(renderer.eot_ids) > 1 or renderer.eot_id != tok.eos_token_id:
        # The engine stops on the config's eos ids (and the tokenizer's): every end of a turn.
        config = json.loads((path / "config.json").read_text())
        config["eos_token_id"] = sorted({tok.eos_token_id, *renderer.eot_ids})
        (path / "config.json").write_text(json.dumps(config, indent=2))
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    torch.manual_seed(seed)
    final_loss = fit_examples(model, _examples(renderer, 64, seed), steps, seed)
    model.save_pretrained(path)
    (path / "family_model.json").write_text(json.dumps({"family": family, "steps": steps,
                                                        "final_loss": final_loss}))
    return path
