"""The trainer-side weight update against real `milepost serve` processes (CPU, gloo).

Engines start from checkpoint A; the "trained" weights are checkpoints B and C of the same shape
(other seeds). After an update every engine reports the version, its greedy output equals
transformers `generate` with the new weights, and its log-probs of that output equal a
transformers forward within 1e-4. Buckets are smaller than the largest tensor (the embedding),
so several engine calls and an oversize bucket are exercised on every update.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GenerationConfig

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess
from milepost.weights.bucket import iter_buckets
from milepost.weights.codec import serialize_named_tensors
from milepost.weights.sync import WeightSync
from milepost.weights.transport import BroadcastTransport, TensorTransport, TransportError
from milepost.weights.verify import WeightMismatchError, verify

PROMPTS = [[5, 17, 300, 42, 8], [9, 101, 33, 250, 7, 64, 12, 480, 3, 77, 19]]
NEW_TOKENS = 10
BUCKET_BYTES = 48_000  # the embedding (512 x 64 fp32) is 131072 bytes: it travels alone
FLAGS = ("--max-total-tokens", "1024", "--page-size", "4", "--weight-version", "start")
Named = list[tuple[str, torch.Tensor]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sync")
    return {name: make_tiny_checkpoint(root / name, "qwen3", seed=i, with_tokenizer=False)
            for i, name in enumerate("abc")}


def start_engines(path: Path, n: int) -> list[ServerProcess]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: ServerProcess(path, *FLAGS), range(n)))


@pytest.fixture(scope="module")
def engines(ckpts: dict[str, Path]):
    started = start_engines(ckpts["a"], 2)
    yield started
    for srv in started:
        srv.close()


def weights(ckpt: Path) -> Named:
    """What a trainer's named_hf_weights() would yield: HF names, the engine's dtype (fp32)."""
    return list(load_file(ckpt / "model.safetensors").items())


class Reference:
    """Transformers' greedy continuation of PROMPTS and its per-token log-probs, per checkpoint."""

    def __init__(self, ckpt: Path) -> None:
        hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None  # like ignore_eos
        cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        self.hf = hf
        with torch.no_grad():
            self.outputs = [hf.generate(torch.tensor([p]), generation_config=cfg)[0, len(p):].tolist()
                            for p in PROMPTS]

    def logprobs(self, prompt: list[int], output: list[int]) -> torch.Tensor:
        """log p(output[k] | prompt + output[:k]) by one teacher-forced forward: [len(output)]."""
        ids = torch.tensor([prompt + output])
        with torch.no_grad():
            logits = self.hf(ids).logits[0].float()
        logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
        return logp.gather(-1, torch.tensor(output)[:, None])[:, 0]


@pytest.fixture(scope="module")
def refs(ckpts: dict[str, Path]) -> dict[str, Reference]:
    return {name: Reference(ckpts[name]) for name in "bc"}


def assert_serves(url: str, ref: Reference, version: str) -> None:
    r = httpx.post(f"{url}/generate", timeout=60, json={
        "input_ids": PROMPTS, "return_logprob": True,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    for prompt, want, out in zip(PROMPTS, ref.outputs, r.json()):
        assert out["output_ids"] == want, url
        assert out["meta_info"]["weight_version"] == version
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, ref.logprobs(prompt, want), atol=1e-4, rtol=0)
    assert httpx.get(f"{url}/get_weight_version").json()["weight_version"] == version


def expected_buckets(named: Named) -> int:
    return len(list(iter_buckets(named, BUCKET_BYTES)))


def test_broadcast_to_two_engines(engines, ckpts, refs) -> None:
    urls = [e.url for e in engines]
    sync = WeightSync(BroadcastTransport(urls, "gloo", timeout_s=30), BUCKET_BYTES)
    try:
        for name in "bc":  # the group is made once and serves many updates
            named = weights(ckpts[name])
            stats = sync.update(iter(named), f"bcast-{name}")
            assert stats.tensors == len(named) and stats.buckets == expected_buckets(named) > 3
            assert stats.bytes == sum(t.numel() * 4 for _, t in named)
            for url in urls:
                assert_serves(url, refs[name], f"bcast-{name}")
    finally:
        sync.close()


def test_tensor_transport_to_one_engine(engines, ckpts, refs) -> None:
    url = engines[0].url
    with TensorTransport([url], timeout_s=30) as transport:
        sync = WeightSync(transport, BUCKET_BYTES)
        for name in "cb":
            stats = sync.update(weights(ckpts[name]), f"tensor-{name}")
            assert stats.buckets == expected_buckets(weights(ckpts[name]))
            assert_serves(url, refs[name], f"tensor-{name}")


def test_checksum_check_passes_then_catches_an_engine_changed_behind_its_back(engines, ckpts
                                                                              ) -> None:
    urls = [e.url for e in engines]
    named = weights(ckpts["b"])
    sync = WeightSync(BroadcastTransport(urls, "gloo", timeout_s=30), BUCKET_BYTES,
                      check_weight_update=True)
    try:
        stats = sync.update(named, "checked")
        assert stats.verified
        assert verify(named, urls) == len(named)
        # One bit of one tensor changes on engine 1 only, by another route.
        victim = "model.layers.1.mlp.down_proj.weight"
        t = dict(named)[victim].clone()
        t.view(-1)[7] = torch.nextafter(t.view(-1)[7], torch.tensor(1e9))
        r = httpx.post(f"{urls[1]}/update_weights_from_tensor", timeout=30, json={
            "serialized_named_tensors": [serialize_named_tensors([(victim, t)])]})
        assert r.status_code == 200, r.text
        with pytest.raises(WeightMismatchError) as err:
            verify(named, urls)
        assert urls[1] in str(err.value) and victim in str(err.value)
        assert urls[0] not in str(err.value) and "1 differ" in str(err.value)
        # The next checked update repairs it.
        assert sync.update(named, "checked-again").verified
    finally:
        sync.close()


def test_dead_engine_is_named_within_bounded_time(ckpts) -> None:
    live, doomed = start_engines(ckpts["a"], 2)
    try:
        sync = WeightSync(BroadcastTransport([live.url, doomed.url], "gloo", timeout_s=20),
                          BUCKET_BYTES)
        sync.update(weights(ckpts["b"]), "before-death")
        doomed.proc.kill()
        doomed.proc.wait()
        t0 = time.monotonic()
        with pytest.raises(TransportError) as err:
            sync.update(weights(ckpts["c"]), "after-death")
        assert time.monotonic() - t0 < 25
        # The dead engine is the one at fault; the live one may be listed as still waiting.
        assert f"engine 1 ({doomed.url}): " in str(err.value)
        assert f"engine 0 ({live.url}): " not in str(err.value)
        with pytest.raises(TransportError, match="unusable after an earlier failure"):
            sync.update(weights(ckpts["c"]), "again")
        sync.close()

        # A new transport including the dead engine fails while creating its group.
        t0 = time.monotonic()
        sync = WeightSync(BroadcastTransport([live.url, doomed.url], "gloo", timeout_s=20),
                          BUCKET_BYTES)
        with pytest.raises(TransportError, match="creating weight group") as err:
            sync.update(weights(ckpts["c"]), "never")
        assert time.monotonic() - t0 < 25 and doomed.url in str(err.value)
        sync.close()
    finally:
        # The live engine may still wait on the dead group (its own timeout is long): no grace.
        live.close(grace_s=1)
        doomed.close()
