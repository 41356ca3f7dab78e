"""An engine with `--quantization fp8` (projection weights stored as e4m3 rows with scales) takes
weight updates over every transport and passes `--check-weight-update-equal` with the
tolerance the format gives for those tensors (bit-exact for the rest); a tensor the update
skipped, or values off by more than the bound, fail it."""

from __future__ import annotations


import httpx
import pytest
from safetensors.torch import load_file

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess
from milepost.testing.transports import TRANSPORT_KINDS, make_transport
from milepost.weights.sync import WeightSync
from milepost.weights.transport import TensorTransport
from milepost.weights.verify import WeightMismatchError, verify

BUCKET_BYTES = 48_000
QKV = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("fp8")
    a = make_tiny_checkpoint(root / "a", "qwen3", seed=0, with_tokenizer=False)
    b = make_tiny_checkpoint(root / "b", "qwen3", seed=1, with_tokenizer=False)
    with ServerProcess(a, "--max-total-tokens", "1024", "--page-size", "4",
                       "--quantization", "fp8") as srv:
        yield srv.url, list(load_file(b / "model.safetensors").items())



@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_fp8_engine_passes_the_equality_check_within_the_format_bound(setup, kind,
                                                                      tmp_path) -> None:
    url, named = setup
    quantized = httpx.get(f"{url}/weights_quantized").json()
    assert quantized["format"] == "fp8_e4m3_row" and QKV in quantized["names"]
    assert "model.embed_tokens.weight" not in quantized["names"]
    sync = WeightSync(make_transport(kind, url, tmp_path / "store"), BUCKET_BYTES, check_equal_once=True,
                      check_weight_update=True)
    try:
        assert sync.update(iter(named), f"{kind}-1").verified
        shifted = [(n, t * 1.5) for n, t in named]  # new values on every tensor
        assert sync.update(iter(shifted), f"{kind}-2").verified
    finally:
        sync.close()
    r = httpx.post(f"{url}/generate", timeout=60, json={"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4


def test_fp8_check_still_catches_a_skipped_tensor_and_values_off_the_bound(setup) -> None:
    url, named = setup
    partial = [(n, t) for n, t in named if n != QKV]
    with TensorTransport([url], timeout_s=30) as transport:
        sync = WeightSync(transport, BUCKET_BYTES, check_equal_once=True)
        with pytest.raises(WeightMismatchError, match="never written") as err:
            sync.update(iter(partial), "partial")  # q_proj keeps the noise
        assert QKV in str(err.value)
        WeightSync(transport, BUCKET_BYTES).update(iter(named), "whole")
    assert verify(named, [url]) == len(named)
    # 20% off: more than e4m3's half-ulp (6.25% of the value) for every row's largest element.
    off = [(n, t * 1.2 if n == QKV else t) for n, t in named]
    with pytest.raises(WeightMismatchError, match=f"{QKV} \\(error .*x the fp8_e4m3_row bound"):
        verify(off, [url])
