"""Engines serving FP8 blockwise, NVFP4 (four-over-six, a layer kept in bf16) and packed INT4
re-quantize every update, over every transport, and pass `--check-weight-update-equal` within the format's
bound (bit-exact for the unquantized tensors); values off the bound fail it. FP8 blockwise with
static input scales (the delayed-scaling trainer's `<module>.input_scale`): every transport
carries them and the check compares them bit for bit (one left out or off by a bit fails)."""

from __future__ import annotations


import httpx
import pytest
import torch
from safetensors.torch import load_file

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess
from milepost.testing.transports import TRANSPORT_KINDS, make_transport
from milepost.weights.sync import WeightSync
from milepost.weights.transport import TensorTransport
from milepost.weights.verify import WeightMismatchError, verify

BUCKET_BYTES = 24_000  # small: gate and up of one layer land in different buckets
UP = "model.layers.0.mlp.up_proj.weight"
FLAGS = {"fp8_block": ["--quantization", "fp8_block"],
         "nvfp4": ["--quantization", "nvfp4", "--nvfp4-four-over-six",
                   "--precision-override", "layers.1-1=bf16"],
         "int4": ["--quantization", "int4"],
         "fp8_block+static": ["--quantization", "fp8_block", "--fp8-activation-scheme", "static"]}
DOWN_SCALE = "model.layers.1.mlp.down_proj.input_scale"


def with_scales(named: list) -> list:
    """The delayed trainer's stream: the weights, then each FP8 linear's float32 input scale
    (q/k/v one value, gate/up one value: they share their input)."""
    value = {"q": 0.011, "k": 0.011, "v": 0.011, "o": 0.013, "gate": 0.017, "up": 0.017, "down": 0.019}
    scales = [(n.removesuffix(".weight") + ".input_scale",
               torch.tensor(value[n.rsplit(".", 2)[-2].removesuffix("_proj")] * (1 + i)))
              for n, _ in named if n.endswith("_proj.weight")
              for i in [int(n.split(".")[2])]]
    return [*named, *scales]


@pytest.fixture(scope="module", params=["fp8_block", "nvfp4", "int4", "fp8_block+static"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lowprec")
    a = make_tiny_checkpoint(root / "a", "qwen3", seed=0, with_tokenizer=False)
    b = make_tiny_checkpoint(root / "b", "qwen3", seed=1, with_tokenizer=False)
    with ServerProcess(a, "--max-total-tokens", "1024", "--page-size", "4",
                       *FLAGS[request.param]) as srv:
        named = list(load_file(b / "model.safetensors").items())
        yield request.param, srv.url, with_scales(named) if "static" in request.param else named



@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_every_transport_requantizes_and_passes_the_check(setup, kind, tmp_path) -> None:
    fmt, url, named = setup
    quantized = httpx.get(f"{url}/weights_quantized").json()
    assert quantized["format"] == fmt.split("+")[0] and UP in quantized["names"]
    assert (DOWN_SCALE in [n for n, _ in named]) == (fmt == "fp8_block+static")
    # The override keeps layer 1 in bf16 on the engine, as the trainer would.
    assert (fmt == "nvfp4") != any(".layers.1." in n for n in quantized["names"])
    sync = WeightSync(make_transport(kind, url, tmp_path / "store"), BUCKET_BYTES, check_equal_once=True,
                      check_weight_update=True)
    try:
        assert sync.update(iter(named), f"{kind}-1").verified
        assert sync.update(iter([(n, t * 1.5) for n, t in named]), f"{kind}-2").verified
    finally:
        sync.close()
    r = httpx.post(f"{url}/generate", timeout=60, json={"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4


def test_values_off_the_bound_fail_the_check(setup) -> None:
    fmt, url, named = setup
    fmt = fmt.split("+")[0]
    with TensorTransport([url], timeout_s=30) as transport:
        WeightSync(transport, BUCKET_BYTES).update(iter(named), "whole")
    assert verify(named, [url]) == len(named)
    # 60% off: more than E2M1's (25%) or E4M3's (6.25%) half-ulp on the largest elements.
    off = [(n, t * 1.6 if n == UP else t) for n, t in named]
    with pytest.raises(WeightMismatchError, match=f"{UP} \\(error .*x the {fmt} bound"):
        verify(off, [url])


def test_static_scales_are_checked_bit_for_bit(setup, tmp_path) -> None:
    fmt, url, named = setup
    if fmt != "fp8_block+static":
        pytest.skip("static input scales: the fp8_block+static engine")
    with TensorTransport([url], timeout_s=30) as transport:
        WeightSync(transport, BUCKET_BYTES).update(iter(named), "scales")
    assert verify(named, [url]) == len(named)  # digests: the float32 scales exactly
    nudged = [(n, torch.nextafter(t, torch.tensor(1.0)) if n == DOWN_SCALE else t) for n, t in named]
    with pytest.raises(WeightMismatchError, match=f"1 differ: {DOWN_SCALE}"):
        verify(nudged, [url])
    # --check-weight-update-equal: a scale the update leaves out keeps the engine's noise.
    sync = WeightSync(TensorTransport([url], timeout_s=30), BUCKET_BYTES, check_equal_once=True)
    try:
        with pytest.raises(WeightMismatchError, match=f"1 never written by the update: {DOWN_SCALE}"):
            sync.update(iter([(n, t) for n, t in named if n != DOWN_SCALE]), "left-out")
    finally:
        sync.close()
