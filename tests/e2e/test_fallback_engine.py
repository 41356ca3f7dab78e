"""The engine on transformers-fallback models: greedy equal to `generate`, exact log-probs, prefix
cache, continuous batching (--model-impl transformers, also for families with a native path); and a
real `milepost serve` that says it falls back and takes weight updates by Hugging Face name.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from milepost.engine.request import Request, RequestOutput
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.models.hf_fallback import HFCausalLM
from milepost.testing.hf_archs import make_tiny_hf_checkpoint
from milepost.testing.server_process import ServerProcess

torch.set_num_threads(1)
ARCHS = ["gemma2", "gpt_oss", "phi3", "gpt_neox"]
VOCAB = 512


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fallback_engine")
    return {a: make_tiny_hf_checkpoint(root / a, a, seed=i) for i, a in enumerate(ARCHS)}


def hf_model(path: Path) -> torch.nn.Module:
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None  # like ignore_eos
    return hf


@torch.no_grad()
def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """generate's greedy tokens, and their log-probs from one full-sequence forward."""
    cfg = GenerationConfig(max_new_tokens=n, do_sample=False, pad_token_id=0)
    seq = hf.generate(torch.tensor([prompt]), generation_config=cfg)[0]
    logp = torch.log_softmax(hf(seq[None]).logits[0].float(), -1)
    rows = torch.arange(len(prompt) - 1, len(seq) - 1)
    return seq[len(prompt):].tolist(), logp[rows, seq[rows + 1]].tolist()


def run_engine(path: Path, prompts: list[list[int]], n: list[int]) -> dict[str, list[RequestOutput]]:
    args = ServerArgs(model_path=path, device="cpu", dtype="float32", page_size=4, model_impl="transformers",
                      chunked_prefill_size=8, max_total_tokens=1024).resolved()
    engine = build_engine(args)[0]
    assert isinstance(engine.runner.model, HFCausalLM)
    outputs: dict[str, list[RequestOutput]] = {}
    for i, (p, k) in enumerate(zip(prompts, n)):
        rid = f"r{i}"
        req = Request(rid=rid, prompt_ids=p, stop_ids=frozenset(), return_logprob=True,
                      params=SamplingParams(max_new_tokens=k, temperature=0.0,
                                                                    ignore_eos=True),
                      on_output=lambda o, rid=rid: outputs.setdefault(rid, []).append(o))
        engine.submit(req)
        engine._drain_inbox(block=False)
        if i == 1:
            for _ in range(3):  # r0/r1 decode before the rest arrive (mixed prefill + decode)
                engine.step()
    while engine.scheduler.has_work:
        engine.step()
    return outputs


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_greedy_and_logprobs_equal_transformers(ckpts, arch: str) -> None:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (13, 3, 7)]
    prompts.append(prompts[0][:10] + [5, 6])  # shares 10 tokens (2 blocks + 2) with r0's prompt
    n = [9, 12, 6, 7]
    outputs = run_engine(ckpts[arch], prompts, n)
    hf = hf_model(ckpts[arch])
    for i, (p, k) in enumerate(zip(prompts, n)):
        out = outputs[f"r{i}"]
        want, want_lp = hf_greedy(hf, p, k)
        assert [t for o in out for t in o.new_token_ids] == want, f"{arch} r{i}"
        got_lp = [lp for o in out for lp in o.new_logprobs]
        assert got_lp == pytest.approx(want_lp, abs=1e-4), f"{arch} r{i}"
    assert outputs["r3"][-1].cached_tokens == 10, "r3 should reuse r0's cached prefix"


def test_serve_falls_back_and_updates_weights(tmp_path: Path) -> None:
    a = make_tiny_hf_checkpoint(tmp_path / "a", "olmo2", seed=0, with_tokenizer=True)
    b = make_tiny_hf_checkpoint(tmp_path / "b", "olmo2", seed=1)
    prompts = [[5, 9, 17, 3, 44, 81, 12], [7, 7, 300]]
    body = {"input_ids": prompts, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}
    with ServerProcess(a, "--page-size", "4", "--max-total-tokens", "2048", "--log-level", "info") as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as c:
        for path in (a, b):
            if path is b:
                r = c.post("/update_weights_from_disk", json={"model_path": str(b), "weight_version": "b"})
                assert r.status_code == 200 and r.json()["success"], r.text
            r = c.post("/generate", json=body)
            assert r.status_code == 200, r.text
            hf = hf_model(path)
            for p, o in zip(prompts, r.json()):
                want, want_lp = hf_greedy(hf, p, 8)
                assert o["output_ids"] == want
                got_lp = [e[0] for e in o["meta_info"]["output_token_logprobs"]]
                assert got_lp == pytest.approx(want_lp, abs=1e-4)
        log = (a / f"server-{srv.port}.log").read_text()
    assert "Olmo2ForCausalLM runs on the transformers fallback" in log
