"""Routed experts of a Qwen3-MoE model, as `milepost serve` reports them over HTTP.

With return_routed_experts the response carries base64 int32 [prompt+completion-1, layers, top_k]:
the experts each token was routed to in each layer. They must be transformers' router picks
(`model.layers.N.mlp.gate` returns (logits, scores, indices)) over the same full sequence, as sets
per token, also for the part of a prompt served from the prefix cache.
"""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess

PAGE = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe"), "qwen3_moe", seed=3,
                                with_tokenizer=False)


@pytest.fixture(scope="module")
def hf(ckpt: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def client(ckpt: Path):
    with ServerProcess(ckpt, "--page-size", str(PAGE), "--chunked-prefill-size", "8") as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def hf_routing(hf: torch.nn.Module, seq: list[int]) -> np.ndarray:
    """transformers' router top-k indices over `seq`: [len(seq), layers, top_k]."""
    picks: dict[int, torch.Tensor] = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(
            lambda _m, _inp, out, i=i: picks.__setitem__(i, out[2].reshape(len(seq), -1)))
        for i, layer in enumerate(hf.model.layers)
    ]
    try:
        with torch.no_grad():
            hf(torch.tensor([seq]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([picks[i] for i in range(len(hf.model.layers))], dim=1).numpy()


def routed(meta: dict, n_tokens: int, hf: torch.nn.Module) -> np.ndarray:
    cfg = hf.config
    data = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    return data.reshape(n_tokens - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok)


def assert_same_routing(got: np.ndarray, seq: list[int], hf: torch.nn.Module) -> None:
    want = hf_routing(hf, seq)[: len(seq) - 1]
    assert got.shape == want.shape
    diff = [(t, layer) for t in range(want.shape[0]) for layer in range(want.shape[1])
            if set(got[t, layer].tolist()) != set(want[t, layer].tolist())]
    assert not diff, f"routing differs at (token, layer) {diff[:5]} of {want.shape[:2]}"


def generate(c: httpx.Client, prompts: list[list[int]], n: int, **sampling: object) -> list[dict]:
    r = c.post("/generate", json={
        "input_ids": prompts, "return_routed_experts": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True,
                            **sampling}})
    assert r.status_code == 200, r.text
    return r.json()


def test_routed_experts_match_transformers_router(client, hf) -> None:
    prompts = [[11, 200, 35, 7, 480, 91, 64, 5, 300, 17, 222], [40, 9], [1, 2, 3, 4, 5, 6, 7]]
    outs = generate(client, prompts, 8)
    outs += generate(client, [[77, 78, 79]], 6, temperature=1.0, sampling_seed=1)  # sampled too
    prompts.append([77, 78, 79])
    for prompt, out in zip(prompts, outs):
        seq = prompt + out["output_ids"]
        assert_same_routing(routed(out["meta_info"], len(seq), hf), seq, hf)


def test_routed_experts_of_a_cached_prefix(client, hf) -> None:
    first = [23, 150, 8, 77, 400, 12, 9, 61, 333, 2, 45]
    out = generate(client, [first], 8)[0]
    # Shares 17 tokens with `first` + its output, which the cache now holds: 4 full blocks and
    # one entry copied out of the partly filled fifth (its routed experts are copied with it).
    second = first + out["output_ids"][:6] + [99, 98, 97]
    again = generate(client, [second], 6)[0]
    assert again["meta_info"]["cached_tokens"] == 17
    seq = second + again["output_ids"]
    assert_same_routing(routed(again["meta_info"], len(seq), hf), seq, hf)


def test_routed_experts_of_one_token(client, hf) -> None:
    """prompt + completion - 1 = 1: only the prompt token went through the model."""
    out = generate(client, [[42]], 1)[0]
    assert_same_routing(routed(out["meta_info"], 2, hf), [42, out["output_ids"][0]], hf)
