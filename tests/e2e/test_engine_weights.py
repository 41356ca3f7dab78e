"""Weight updates of a real `milepost serve` process over HTTP: tensor, disk and distributed (gloo).

Every good update sets the weight version (on /get_weight_version and in later responses) and the
greedy output afterwards equals transformers `generate` with the new weights; the prompts are
repeated across updates, so a prefix cache kept from the old weights would show. Every bad update
(unknown name, wrong shape, wrong dtype, missing directory) carries a full set of new tensors
besides the bad one, is answered 400 naming the culprit, and leaves the old weights fully in place.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GenerationConfig

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess, free_port
from milepost.weights.codec import serialize_named_tensors
from milepost.weights.process_group import WeightGroup, init_weight_group
from milepost.weights.sender import broadcast_named_tensors, describe_named_tensors

PROMPTS = [[5, 17, 300, 42, 8], [9, 101, 33, 250, 7, 64, 12, 480, 3, 77, 19, 205, 6]]
NEW_TOKENS = 12
GROUP = "milepost_test_group"
Named = list[tuple[str, torch.Tensor]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weights")
    out = {name: make_tiny_checkpoint(root / name, "qwen3", seed=i, with_tokenizer=False)
           for i, name in enumerate("abc")}
    out["wide"] = make_tiny_checkpoint(root / "wide", "qwen3", with_tokenizer=False,
                                       intermediate_size=96)
    return out


@pytest.fixture(scope="module")
def expected(ckpts: dict[str, Path]) -> dict[str, list[list[int]]]:
    """Greedy continuations of PROMPTS under checkpoints a, b and c, by transformers."""
    cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    out = {}
    for name in "abc":
        hf = AutoModelForCausalLM.from_pretrained(ckpts[name], dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None  # like ignore_eos
        with torch.no_grad():
            out[name] = [hf.generate(torch.tensor([p]), generation_config=cfg)[0, len(p):].tolist()
                         for p in PROMPTS]
    return out


@pytest.fixture(scope="module")
def server(ckpts: dict[str, Path]):
    with ServerProcess(ckpts["a"], "--page-size", "4", "--chunked-prefill-size", "8",
                       "--weight-version", "a0") as srv:
        yield srv


@pytest.fixture
def client(server: ServerProcess):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def tensors(ckpt: Path) -> Named:
    return sorted(load_file(ckpt / "model.safetensors").items())


def greedy(c: httpx.Client) -> tuple[list[list[int]], list[dict]]:
    r = c.post("/generate", json={"input_ids": PROMPTS, "sampling_params": {
        "max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return [o["output_ids"] for o in r.json()], [o["meta_info"] for o in r.json()]


def assert_serving(c: httpx.Client, want: list[list[int]], version: str) -> None:
    assert c.get("/get_weight_version").json() == {"weight_version": version}
    outputs, metas = greedy(c)
    assert outputs == want
    for meta in metas:
        assert meta["weight_version"] == version
        assert meta["output_token_weight_versions"] == [version] * NEW_TOKENS


def from_disk(c: httpx.Client, path: Path | str, version: str) -> httpx.Response:
    return c.post("/update_weights_from_disk", json={"model_path": str(path),
                                                     "weight_version": version})


def from_tensor(c: httpx.Client, named: Named, version: str) -> httpx.Response:
    return c.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [serialize_named_tensors(named)], "weight_version": version})


def test_update_from_tensor(client, ckpts, expected) -> None:
    r = from_tensor(client, tensors(ckpts["b"]), "tensor-b")
    assert r.status_code == 200 and r.json()["success"], r.text
    assert r.json()["weight_version"] == "tensor-b"
    assert_serving(client, expected["b"], "tensor-b")


def test_update_from_disk(client, ckpts, expected) -> None:
    greedy(client)  # fill the prefix cache under the old weights
    r = from_disk(client, ckpts["c"], "disk-c")
    assert r.status_code == 200 and r.json()["success"], r.text
    assert_serving(client, expected["c"], "disk-c")


class TrainerSide:
    """The test process as rank 0 of a gloo weight group with the server (rank 1)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.pool = ThreadPoolExecutor(1)
        port = free_port()
        body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": 2, "group_name": GROUP, "backend": "gloo"}
        joined = self.pool.submit(self._post, "/init_weights_update_group", body)
        self.group: WeightGroup = init_weight_group("127.0.0.1", port, 0, 2, GROUP, "gloo",
                                                    timeout_s=30)
        r = joined.result(timeout=60)
        assert r.status_code == 200, r.text

    def _post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=60)

    def update(self, named: Named, version: str,
               before_broadcast: Callable[[], None] = lambda: None) -> httpx.Response:
        """POST the update in a thread while broadcasting, as a trainer does."""
        names, dtypes, shapes = describe_named_tensors(named)
        answer = self.pool.submit(self._post, "/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": GROUP,
            "weight_version": version})
        before_broadcast()
        broadcast_named_tensors(self.group, named)
        return answer.result(timeout=60)

    def close(self) -> httpx.Response:
        r = self._post("/destroy_weights_update_group", {"group_name": GROUP})
        self.group.close()
        self.pool.shutdown()
        return r


def test_update_from_distributed(client, server, ckpts, expected) -> None:
    trainer = TrainerSide(server.url)
    try:
        r = trainer.update(tensors(ckpts["b"]), "dist-b")
        assert r.status_code == 200 and r.json()["success"], r.text
        assert_serving(client, expected["b"], "dist-b")

        def meanwhile() -> None:  # the server waits for the broadcast, and keeps generating
            time.sleep(0.2)
            assert_serving(client, expected["b"], "dist-b")

        r = trainer.update(tensors(ckpts["c"]), "dist-c", before_broadcast=meanwhile)
        assert r.status_code == 200, r.text  # the group serves many updates
        assert_serving(client, expected["c"], "dist-c")
    finally:
        r = trainer.close()
    assert r.status_code == 200, r.text
    r = client.post("/destroy_weights_update_group", json={"group_name": GROUP})
    assert r.status_code == 400 and GROUP in r.text


def spoil(named: Named, how: str) -> tuple[Named, str]:
    """A full update with one bad entry, and the tensor name the refusal must mention."""
    named = list(named)
    i = next(i for i, (n, _) in enumerate(named) if n.endswith("layers.1.mlp.up_proj.weight"))
    name, t = named[i]
    if how == "unknown":
        name = "model.layers.1.mlp.upp_proj.weight"
    elif how == "shape":
        t = t[:-1]
    elif how == "dtype":
        t = t.to(torch.bfloat16)
    named[i] = (name, t)
    return named, name


BAD = ["unknown", "shape", "dtype"]


@pytest.mark.parametrize("how", BAD)
def test_bad_tensor_update_changes_nothing(client, ckpts, expected, how) -> None:
    assert from_disk(client, ckpts["a"], f"good-{how}").status_code == 200
    named, culprit = spoil(tensors(ckpts["c"]), how)
    r = from_tensor(client, named, "never")
    assert r.status_code == 400 and culprit in r.json()["message"], r.text
    assert_serving(client, expected["a"], f"good-{how}")


@pytest.mark.parametrize("how", ["missing", "shape"])
def test_bad_disk_update_changes_nothing(client, ckpts, expected, how, tmp_path) -> None:
    assert from_disk(client, ckpts["a"], f"good-disk-{how}").status_code == 200
    path = tmp_path / "no-such-checkpoint" if how == "missing" else ckpts["wide"]
    r = from_disk(client, path, "never")
    assert r.status_code == 400, r.text
    culprit = str(path) if how == "missing" else "model.layers.0.mlp.up_proj.weight"
    assert culprit in r.json()["message"]
    assert_serving(client, expected["a"], f"good-disk-{how}")


def test_bad_distributed_updates_change_nothing_and_keep_the_group(client, server, ckpts,
                                                                  expected) -> None:
    assert from_disk(client, ckpts["a"], "good-dist").status_code == 200
    trainer = TrainerSide(server.url)
    try:
        for how in BAD:
            named, culprit = spoil(tensors(ckpts["c"]), how)
            r = trainer.update(named, "never")
            assert r.status_code == 400 and culprit in r.json()["message"], (how, r.text)
            assert_serving(client, expected["a"], "good-dist")
        r = trainer.update(tensors(ckpts["b"]), "dist-after-bad")  # the group is still in step
        assert r.status_code == 200, r.text
        assert_serving(client, expected["b"], "dist-after-bad")
    finally:
        assert trainer.close().status_code == 200
