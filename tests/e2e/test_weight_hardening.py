"""Hostile weight updates against a real engine: each answers 400 and the engine keeps serving its
old weights (same weight digests, same weight_version). Covers a pickle that would run code, an
integer or bool checkpoint on disk, NaN weights by tensor and by disk, a full disk-delta version
missing one tensor, and delta indexes with fields of the wrong type."""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess
from milepost.weights.codec import serialize_named_tensors
from milepost.weights.disk_delta import INDEX_NAME, DeltaWriter, version_dir

FLAGS = ("--max-total-tokens", "1024", "--page-size", "4")


class _RunsCode:
    """Unpickling this creates `marker` (what an attacker's payload would do, harmlessly)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.mkdir, (str(self.marker),))


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("hard")
    a = make_tiny_checkpoint(root / "a", "qwen3", seed=0, with_tokenizer=False)
    b = make_tiny_checkpoint(root / "b", "qwen3", seed=1, with_tokenizer=False)
    with ServerProcess(a, *FLAGS) as srv:
        yield srv.url, list(load_file(b / "model.safetensors").items()), root


def served(url: str) -> tuple[dict[str, str], str]:
    """Digests of every weight the engine holds, and its weight_version."""
    r = httpx.get(f"{url}/weights_checksum", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["checksums"], r.json()["weight_version"]


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def test_tensor_update_refuses_a_pickle_that_runs_code(setup, tmp_path) -> None:
    url, named, _ = setup
    before = served(url)
    marker = tmp_path / "pwned"
    direct = pickle.dumps([(named[0][0], _RunsCode(marker))])
    # The same call hidden one level down, in the bytes torch.load would read for a storage.
    inner = io.BytesIO()
    torch.save(_RunsCode(marker), inner)
    nested = pickle.dumps([(named[0][0], _Nested(inner.getvalue()))])
    for raw in (direct, nested):
        r = post(url, "/update_weights_from_tensor", {
            "serialized_named_tensors": [base64.b64encode(raw).decode()], "weight_version": "x"})
        assert r.status_code == 400, r.text
        assert "refused" in r.json()["message"]
    assert not marker.exists()
    assert served(url) == before


class _Nested:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> tuple:
        import torch.storage
        return (torch.storage._load_from_bytes, (self.data,))


def test_tensor_update_refuses_nan_and_integer_tensors(setup) -> None:
    url, named, _ = setup
    before = served(url)
    name, t = named[3]
    nan = t.clone()
    nan.view(-1)[7] = float("nan")
    for bad, why in (((name, nan), "NaN or infinite"), ((name, t.to(torch.int32)), "cast"),
                     ((name, t > 0), "cast")):
        data = serialize_named_tensors([*named[:3], bad])
        r = post(url, "/update_weights_from_tensor", {"serialized_named_tensors": [data]})
        assert r.status_code == 400 and why in r.json()["message"], r.text
        assert name in r.json()["message"]
    assert served(url) == before


@pytest.mark.parametrize("how", ["int8", "int64", "bool", "nan", "inf"])
def test_disk_update_refuses_integer_bool_and_non_finite_checkpoints(setup, how, tmp_path) -> None:
    url, named, _ = setup
    before = served(url)
    victim = named[4][0]
    out = {}
    for n, t in named:
        if how in ("int8", "int64", "bool"):
            t = t > 0 if how == "bool" else t.to(getattr(torch, how))
        elif n == victim:
            t = t.clone()
            t.view(-1)[0] = float(how)
        out[n] = t.contiguous()
    save_file(out, str(tmp_path / "model.safetensors"))
    r = post(url, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": how})
    assert r.status_code == 400, r.text
    expected = "NaN or infinite" if how in ("nan", "inf") else "cannot cast"
    assert expected in r.json()["message"] and "no weight was changed" in r.json()["message"]
    assert served(url) == before


def test_disk_delta_full_version_missing_a_tensor_is_refused(setup, tmp_path) -> None:
    url, named, _ = setup
    before = served(url)
    store = tmp_path / "store"
    w = DeltaWriter(store)
    w.begin("partial")
    for n, t in named[1:]:  # one weight left out of a "full" version
        w.add(n, t)
    w.commit()
    r = post(url, "/weights_delta/prepare", {"root": str(store), "version": 0})
    assert r.status_code == 400 and "lacks 1 of this model's weights" in r.json()["message"], r.text
    assert named[0][0] in r.json()["message"]
    assert post(url, "/weights_delta/commit", {"version": 0}).status_code == 400
    assert served(url) == before


@pytest.mark.parametrize("field, value, where", [
    ("offset", "0", "offset"), ("tensors", [], "tensors"), ("shape", [-1, 4], "shape"),
    ("version", "0", "version"), ("length", None, "length"),
])
def test_disk_delta_index_with_wrong_types_answers_400(setup, tmp_path, field, value, where) -> None:
    url, named, _ = setup
    before = served(url)
    store = tmp_path / "store"
    w = DeltaWriter(store)
    w.begin("crafted")
    for n, t in named:
        w.add(n, t)
    w.commit()
    path = version_dir(store, 0) / INDEX_NAME
    index = json.loads(path.read_text())
    if field in ("tensors", "version"):
        index[field] = value
    else:
        index["tensors"][named[0][0]][field] = value
    path.write_text(json.dumps(index))
    r = post(url, "/weights_delta/prepare", {"root": str(store), "version": 0})
    assert r.status_code == 400, r.text
    assert "not a valid delta index" in r.json()["message"] and where in r.json()["message"]
    assert served(url) == before


@pytest.mark.parametrize("path, body", [
    ("/weights_delta/prepare", {"root": "/tmp", "version": "0"}),
    ("/weights_delta/commit", {"version": 0, "flush_cache": "yes"}),
    ("/weights_randomize", {"seed": "1"}),
    ("/weights_dequantized", {"names": "model.norm.weight"}),
    ("/update_weights_from_p2p", {"names": ["a"], "dtypes": ["float32"], "shapes": [["1"]],
                                  "group_name": "g"}),
    ("/update_weights_from_p2p", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]],
                                  "group_name": "g", "src_rank": True}),
])
def test_weight_routes_take_no_coerced_types(setup, path, body) -> None:
    url, _, _ = setup
    before = served(url)
    r = post(url, path, body)
    assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
    assert served(url) == before
