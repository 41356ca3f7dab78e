"""An engine serving a tiny Qwen3-MoE with `--quantization fp8_block` (experts in FP8, bf16 in
the sender, as bf16-train-fp8-serve has it) re-quantizes the experts on every update over every
transport and passes `--check-weight-update-equal` within the FP8 bound; experts off the bound
fail it."""

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

BUCKET_BYTES = 24_000  # small: an update spans several buckets
DOWN = "model.layers.1.mlp.experts.5.down_proj.weight"


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lowprec_moe")
    a = make_tiny_checkpoint(root / "a", "qwen3_moe", seed=0, with_tokenizer=False)
    b = make_tiny_checkpoint(root / "b", "qwen3_moe", seed=1, with_tokenizer=False)
    with ServerProcess(a, "--max-total-tokens", "1024", "--page-size", "4",
                       "--quantization", "fp8_block") as srv:
        yield srv.url, list(load_file(b / "model.safetensors").items())


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_experts_requantized_over_every_transport(moe, kind, tmp_path) -> None:
    url, named = moe
    quantized = httpx.get(f"{url}/weights_quantized").json()
    assert quantized["format"] == "fp8_block" and DOWN in quantized["names"]
    assert not any(n.endswith("mlp.gate.weight") for n in quantized["names"])  # routers: bf16
    sync = WeightSync(make_transport(kind, url, tmp_path / "store"), BUCKET_BYTES, check_equal_once=True,
                      check_weight_update=True)
    try:
        assert sync.update(iter([(n, t * 1.25) for n, t in named]), f"{kind}-1").verified
    finally:
        sync.close()
    r = httpx.post(f"{url}/generate", timeout=60, json={"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4


def test_experts_off_the_bound_fail_the_check(moe) -> None:
    url, named = moe
    with TensorTransport([url], timeout_s=30) as transport:
        WeightSync(transport, BUCKET_BYTES).update(iter(named), "whole")
    assert verify(named, [url]) == len(named)
    off = [(n, t * 1.2 if n == DOWN else t) for n, t in named]  # 20% > E4M3's 6.25% half-ulp
    with pytest.raises(WeightMismatchError, match=f"{DOWN} \\(error .*x the fp8_block bound"):
        verify(off, [url])
