"""Per-channel FP8 MoE experts end to end on CPU (lowprec/experts_fp8_row.py): an engine server
started on a tiny Qwen3-MoE written in compressed-tensors' FP8-dynamic layout serves its experts
as stored, re-quantizes them per row on every update over every transport and passes
`--check-weight-update-equal` within the row format's bound; experts off the bound fail it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.quant_checkpoints import write_fp8
from milepost.testing.server_process import ServerProcess
from milepost.testing.transports import TRANSPORT_KINDS, make_transport
from milepost.weights.fp8 import FORMAT
from milepost.weights.sync import WeightSync
from milepost.weights.transport import TensorTransport
from milepost.weights.verify import WeightMismatchError, verify

BUCKET_BYTES = 24_000  # small: an update spans several buckets
EXPERT = "model.layers.1.mlp.experts.5.down_proj.weight"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("fp8ch_moe")
    src = make_tiny_checkpoint(root / "a", "qwen3_moe", seed=0, with_tokenizer=False)
    b = make_tiny_checkpoint(root / "b", "qwen3_moe", seed=1, with_tokenizer=False)
    write_fp8(src, root / "ch", "channel")
    with ServerProcess(root / "ch", "--max-total-tokens", "1024", "--page-size", "4") as srv:
        yield srv.url, list(load_file(b / "model.safetensors").items())


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_every_transport_requantizes_experts_and_passes_the_check(setup, kind: str, tmp_path: Path) -> None:
    url, named = setup
    quantized = httpx.get(f"{url}/weights_quantized").json()
    assert quantized["format"] == FORMAT and EXPERT in quantized["names"]
    assert not any(n.endswith("mlp.gate.weight") for n in quantized["names"])  # routers: as stored
    sync = WeightSync(make_transport(kind, url, tmp_path / "store"), BUCKET_BYTES, check_equal_once=True,
                      check_weight_update=True)
    try:
        assert sync.update(iter(named), f"{kind}-1").verified
        assert sync.update(iter([(n, t * 1.5) for n, t in named]), f"{kind}-2").verified
    finally:
        sync.close()
    r = httpx.post(f"{url}/generate", timeout=60, json={
        "input_ids": [5, 6, 7], "return_routed_experts": True,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4
    assert r.json()["meta_info"]["routed_experts"]


def test_expert_values_off_the_bound_fail_the_check(setup) -> None:
    url, named = setup
    with TensorTransport([url], timeout_s=30) as transport:
        WeightSync(transport, BUCKET_BYTES).update(iter(named), "whole")
    assert verify(named, [url]) == len(named)
    off = [(n, t * 1.2 if n == EXPERT else t) for n, t in named]  # 20% > E4M3's 6.25% half-ulp
    with pytest.raises(WeightMismatchError, match=f"{EXPERT} \\(error .*x the {FORMAT} bound"):
        verify(off, [url])
