"""Per-tensor / per-channel FP8 and INT4 W4A16 checkpoints served on the GPU as stored
(lowprec/quant_checkpoint.py): the CUDA stores hold the checkpoint's bytes and scales (the values
the CPU reader gives), a per-tensor checkpoint decodes as its blockwise equivalent through the
native FP8 GEMMs, a per-channel one as its dequantized bf16 weights. Run on the accelerator
machine: `python -m pytest -q -m gpu tests/gpu/test_quant_checkpoints_cuda.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.lowprec.checkpoint_weights import read_weight
from milepost.lowprec.engine_store import QuantizedLinear
from milepost.lowprec.quant_checkpoint import checkpoint_quant
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.engine_greedy import greedy_outputs, random_prompts
from milepost.testing.quant_checkpoints import write_fp8, write_int4

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Every projection tile-aligned (q 256, k/v 128, gate/up 512 rows; K 256 / 512): native GEMMs.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qck") / "bf16", "qwen3", seed=3,
                                with_tokenizer=False, hidden_size=256, intermediate_size=512,
                                head_dim=64, num_attention_heads=4, num_key_value_heads=2)


def _engine(path: Path, **kw: object) -> object:
    args = ServerArgs(model_path=path, device="cuda", dtype="bfloat16", page_size=16,
                      max_total_tokens=4096, **kw).resolved()
    return build_engine(args)[0]


def _greedy(engine: object) -> tuple[list[list[int]], list[list[float]]]:
    return greedy_outputs(engine, random_prompts((37, 5, 130), seed=7), max_new_tokens=16)


def _stored(path: Path) -> dict[str, object]:
    """HF name -> the QTensor the CPU reader makes of each quantized weight."""
    ckpt, t = checkpoint_quant(path), load_file(path / "model.safetensors")
    out = {}
    for n, v in t.items():
        if n.endswith(".weight_packed") or (n.endswith(".weight") and v.dtype == torch.float8_e4m3fn):
            name = n.removesuffix("_packed") if n.endswith("_packed") else n
            out[name] = read_weight(ckpt, name, v, t.get)
    return out


def test_per_tensor_fp8_on_native_gemms(src: Path, tmp_path: Path) -> None:
    write_fp8(src, tmp_path / "pt", "tensor")
    a = _engine(tmp_path / "pt")
    model = a.runner.model
    assert any(isinstance(m, QuantizedLinear) and m.native for m in model.modules()), \
        "no native FP8 linear: is this a Hopper GPU with an FP8 GEMM that passed the probe?"
    for n, q in _stored(tmp_path / "pt").items():
        m, j = model.fp8_weights._part(model.weight_view(n))
        row, rows, held = m.qparts[j]
        assert torch.equal(m.weight[row:row + rows].view(torch.uint8).cpu(), q.values.view(torch.uint8)), n
        assert torch.equal(held.scales.cpu(), q.scales), n
    # The blockwise equivalent: every tile's scale the tensor's.
    blk = tmp_path / "blk"
    blk.mkdir()
    t = load_file(tmp_path / "pt" / "model.safetensors")
    for n, q in _stored(tmp_path / "pt").items():
        del t[n.removesuffix("weight") + "weight_scale"]
        t[n.removesuffix("weight") + "weight_scale_inv"] = q.scales
    save_file(t, blk / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "pt" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (blk / "config.json").write_text(json.dumps(cfg))
    got = _greedy(a)
    del a, model
    torch.cuda.empty_cache()
    assert got == _greedy(_engine(blk))


def test_per_channel_fp8_is_its_dequantized_weights(src: Path, tmp_path: Path) -> None:
    write_fp8(src, tmp_path / "pc", "channel")
    a = _engine(tmp_path / "pc", fp8_weight_only=True)  # W8A16; W8A8: test_fp8_rowwise_cuda.py
    model = a.runner.model
    for n, q in _stored(tmp_path / "pc").items():
        view = model.weight_view(n)
        assert torch.equal(view.view(torch.uint8).cpu(), q.values.view(torch.uint8)), n
        assert torch.equal(model.fp8_weights.scale_of(view).cpu(), q.scales.reshape(-1)), n
    got = _greedy(a)
    del a, model
    torch.cuda.empty_cache()
    # The row store's forward multiplies the dequantized weights in bf16: the same as serving them.
    assert got == _greedy(_engine(tmp_path / "pc", dequantize_checkpoint=True))


def test_int4_checkpoint_in_the_w4a16_store(src: Path, tmp_path: Path) -> None:
    from milepost.kernels.int4_gemm import kernel_ok

    write_int4(src, tmp_path / "i4", 128)
    a = _engine(tmp_path / "i4")
    assert kernel_ok(torch.device("cuda")), "the W4A16 kernel failed its probe (see the log)"
    model = a.runner.model
    for n, q in _stored(tmp_path / "i4").items():
        m, j = model.fp8_weights._part(model.weight_view(n))
        row, rows, _ = m.qparts[j]
        assert torch.equal(m.weight[row:row + rows].cpu(), q.values), n
        assert torch.equal(m.weight_scale[row:row + rows].cpu(), q.scales), n
    toks, lps = _greedy(a)
    assert all(len(t) == 16 for t in toks) and all(torch.isfinite(torch.tensor(lp)).all() for lp in lps)


def test_awq_checkpoint_in_the_w4a16_store_with_zero_points(src: Path, tmp_path: Path) -> None:
    """AWQ (zero points) served as stored on CUDA: the packed bytes, scales and zero points are
    the CPU reader's; the Triton dequantization gives torch's (v - zero) * scale bits, and the
    W4A16 decode kernel multiplies those weights (within bf16 accumulation of the reference)."""
    from milepost.kernels.int4_gemm import dequantize_int4_triton, kernel_ok, w4a16_mm
    from milepost.lowprec.quantize import dequantize
    from milepost.testing.quant_checkpoints import write_awq

    write_awq(src, tmp_path / "awq", 128)
    a = _engine(tmp_path / "awq")
    assert kernel_ok(torch.device("cuda")), "the W4A16 kernels failed their probe (see the log)"
    model = a.runner.model
    ckpt, t = checkpoint_quant(tmp_path / "awq"), load_file(tmp_path / "awq" / "model.safetensors")
    checked = 0
    for n in (n for n in t if n.endswith(".qweight")):
        name = n.removesuffix(".qweight") + ".weight"
        q = read_weight(ckpt, name, t[n], t.get)
        m, j = model.fp8_weights._part(model.weight_view(name))
        row, rows, _ = m.qparts[j]
        assert torch.equal(m.weight[row:row + rows].cpu(), q.values), name
        assert torch.equal(m.weight_scale[row:row + rows].cpu(), q.scales), name
        assert torch.equal(m.weight_zero[row:row + rows].cpu(), q.zeros), name
        k = m.in_features
        w = dequantize_int4_triton(m.weight, m.weight_scale, k, torch.bfloat16, m.weight_zero)
        assert torch.equal(w[row:row + rows].cpu(), dequantize(q).bfloat16()), name
        x = torch.randn(3, k, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), w.float())
        y = w4a16_mm(x, m.weight, m.weight_scale, k, zeros=m.weight_zero).float()
        assert ((y - ref).abs() <= 1e-2 * ref.abs().amax(1, keepdim=True)).all(), name
        checked += 1
    assert checked == 7 * 2
    toks, lps = _greedy(a)
    assert all(len(t) == 16 for t in toks) and all(torch.isfinite(torch.tensor(lp)).all() for lp in lps)
