"""Low precision on CUDA: the quantizer gives the CPU's bits on the GPU (the contract across
devices), the Triton activation quantizer gives the reference's bits, the FP8 blockwise GEMM
matches the emulated product, and an engine model stores fp8 weights and runs FP8 GEMMs with
the same quantized values as the CPU path.
Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_lowprec_cuda.py`.
"""

from __future__ import annotations

import math

import pytest
import torch

from milepost.lowprec.contract import Contract
from milepost.lowprec.quantize import FORMATS, dequantize, quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _sample(rows: int, cols: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-5, 3, rows).reshape(-1, 1)
    x[2, 7], x[3, 300] = math.nan, -math.inf
    return x


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("role", ["weight", "activation"])
def test_cuda_quantizer_gives_the_cpu_bits(fmt: str, role: str) -> None:
    x = _sample(256, 512)
    cpu = quantize(x, fmt, role, four_over_six=fmt == "nvfp4")
    gpu = quantize(x.cuda(), fmt, role, four_over_six=fmt == "nvfp4")
    a, b = dequantize(cpu), dequantize(gpu).cpu()
    finite = ~torch.isnan(a)  # a NaN's sign bit is not part of the contract
    bytes_cpu = cpu.values.view(torch.uint8).reshape(-1)
    bytes_gpu = gpu.values.cpu().view(torch.uint8).reshape(-1)
    keep = finite.reshape(-1) if fmt not in ("nvfp4", "int4") else slice(None)  # packed: 2 a byte
    assert torch.equal(bytes_cpu[keep], bytes_gpu[keep])
    assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_triton_activation_quantizer_matches_the_reference_bits() -> None:
    from milepost.kernels.fp8_gemm import quantize_act_1x128

    x = _sample(64, 1024).to(torch.bfloat16)
    q, s = quantize_act_1x128(x.cuda())
    ref = quantize(x, "fp8_block", "activation")
    finite = ~torch.isnan(ref.values.float())
    assert torch.equal(q.cpu().view(torch.uint8)[finite], ref.values.view(torch.uint8)[finite])
    assert torch.isnan(q.cpu().float()[~finite]).all()
    assert torch.equal(s.cpu().nan_to_num(-1.0), ref.scales.nan_to_num(-1.0))


def test_fp8_block_gemm_matches_the_emulated_product() -> None:
    """The GEMM the probe picked, and the Triton fallback, against the emulated product at the
    M of a decode and of prefills, and at a K that cuBLAS does not take (routed to the fallback)."""
    from milepost.kernels.fp8_gemm import (
        block_backend,
        emulated_block_mm,
        fp8_block_linear,
        quantize_act_1x128,
    )

    dev = torch.device("cuda")
    backend = block_backend(dev)
    assert backend in ("scaled_mm", "triton"), "no native FP8 blockwise GEMM on this device"
    for use in sorted({backend, "triton", "decode"}):
        for m, k in ((1, 1024), (16, 1024), (200, 1024), (300, 1024), (5, 640)):  # K/128 = 5: fallback
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = quantize(torch.randn(768, k, device=dev) * 0.02, "fp8_block")
            y = fp8_block_linear(x, w.values, w.scales, use)
            xq, sx = quantize_act_1x128(x)
            ref = emulated_block_mm(xq, sx, w.values, w.scales, torch.float32)
            assert y.shape == (m, 768) and torch.isfinite(y).all(), (use, m)
            assert torch.allclose(y.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item()), (use, m)


def test_decode_gemm_configs_give_the_emulated_product() -> None:
    """Every DECODE_TABLE config (the rule's for the Qwen3-4B projections when the table is
    empty) at its own shape and M, and the per-M-bucket choice of the GEMM at decode M."""
    from milepost.kernels import fp8_gemm as fg

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cases = {(n, k, m): cfg for (n, k, m), cfg in fg.DECODE_TABLE.items()} or {
        (n, k, m): fg.decode_config(m, n, k, sms) for n, k in ((6144, 2560), (2560, 4096), (19456, 2560),
                                                               (2560, 9728)) for m in fg.DECODE_BUCKETS}
    weights = {}
    for (n, k, m), cfg in sorted(cases.items()):
        if (n, k) not in weights:
            weights[(n, k)] = quantize(torch.randn(n, k, device=dev) * 0.02, "fp8_block")
        w = weights[(n, k)]
        x = torch.randn(max(1, m - 3), k, device=dev, dtype=torch.bfloat16)  # M inside the bucket
        xq, sx = fg.quantize_act_1x128(x)
        ref = fg.emulated_block_mm(xq, sx, w.values, w.scales, torch.float32)
        y = fg.decode_block_mm(x, w.values, w.scales, torch.bfloat16, cfg)
        assert fg._agrees(y.float(), ref), ((n, k, m), cfg)
    assert {fg.block_backend(dev, m) for m in fg.DECODE_BUCKETS} <= {"scaled_mm", "triton", "decode", "stream"}


def test_engine_model_stores_fp8_and_keeps_the_contract(tmp_path) -> None:
    from safetensors.torch import load_file

    from milepost.engine.weight_update import WeightLoader
    from milepost.lowprec.engine_store import store_quantized
    from milepost.models.registry import load_model
    from milepost.testing.checkpoints import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=3, with_tokenizer=False,
                                hidden_size=256, intermediate_size=512, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=128)
    contract = Contract("fp8_block", "fp8_block")
    models = {}
    for device in ("cpu", "cuda"):
        model = load_model(ckpt, torch.bfloat16, device)
        model.fuse_projections()
        models[device] = (model, store_quantized(model, contract))
    gpu, store = models["cuda"]
    qkv = gpu.model.layers[0].self_attn.qkv_proj
    assert qkv.native and qkv.weight.dtype == torch.float8_e4m3fn
    sent = {n: t.float() * 1.3 for n, t in load_file(ckpt / "model.safetensors").items()}
    for model, _ in models.values():
        WeightLoader(model).from_named([(n, t.to(torch.bfloat16)) for n, t in sent.items()])
    name = "model.layers.1.mlp.up_proj.weight"
    cpu_vals = models["cpu"][1].dequantized(models["cpu"][0].weight_view(name))[0]
    assert torch.equal(store.dequantized(gpu.weight_view(name))[0].cpu(), cpu_vals)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    y_gpu = qkv(x.cuda()).float().cpu()
    y_cpu = models["cpu"][0].model.layers[0].self_attn.qkv_proj(x).float()
    assert torch.allclose(y_gpu, y_cpu, rtol=3e-2, atol=3e-2 * y_cpu.abs().max().item())


def test_triton_paged_attention_reads_an_fp8_pool() -> None:
    """Decode and prefill over an fp8 pool equal the same kernels over the pool's values in bf16,
    and the Triton store saturates like the CPU path."""
    from milepost.kernels import paged_attention as pa
    from milepost.models.attention import to_cache

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    slots, heads, kvh, d, page = 64, 8, 2, 128, 16
    k = torch.randn(slots, kvh, d, device=dev, generator=gen, dtype=torch.bfloat16) * 3
    v = torch.randn(slots, kvh, d, device=dev, generator=gen, dtype=torch.bfloat16)
    k[0, 0, 0] = 1000.0  # saturates
    kc8 = torch.empty(slots, kvh, d, device=dev, dtype=torch.float8_e4m3fn)
    vc8 = torch.empty_like(kc8)
    pa.store_kv(kc8, vc8, k, v, torch.arange(slots, device=dev))
    assert torch.equal(kc8.view(torch.uint8), to_cache(k, torch.float8_e4m3fn).view(torch.uint8))
    kc, vc = kc8.to(torch.bfloat16), vc8.to(torch.bfloat16)
    tables = torch.arange(4, device=dev).reshape(2, 2)
    lens = torch.tensor([30, 17], device=dev)
    q = torch.randn(2, heads, d, device=dev, generator=gen, dtype=torch.bfloat16)
    a = pa.paged_decode(q, kc8, vc8, tables, lens, 0.1, page, 1)
    b = pa.paged_decode(q, kc, vc, tables, lens, 0.1, page, 1)
    assert torch.allclose(a.float(), b.float(), atol=1e-2)
    cu = torch.tensor([0, 30, 47], device=dev)
    ts, tm = pa.prefill_tiles([30, 17])
    ts, tm = (torch.tensor(t, device=dev, dtype=torch.int32) for t in (ts, tm))
    qp = torch.randn(47, heads, d, device=dev, generator=gen, dtype=torch.bfloat16)
    a = pa.paged_prefill(qp, kc8, vc8, tables, lens, cu, ts, tm, 0.1, page)
    b = pa.paged_prefill(qp, kc, vc, tables, lens, cu, ts, tm, 0.1, page)
    assert torch.allclose(a.float(), b.float(), atol=1e-2)


def test_trainer_fp8_linear_native_equals_the_emulated_values() -> None:
    """The trainer's native FP8 GEMMs (forward, data and weight gradients) against the emulated
    path on the same quantized values (accumulation order differs: bf16 tolerance)."""
    from milepost.lowprec.linear import LowPrecLinearFn, qdq

    dev = torch.device("cuda")
    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 384, bias=False, device=dev, dtype=torch.bfloat16)
    from milepost.lowprec.linear import apply_train_precision

    holder = torch.nn.Module()
    holder.model = torch.nn.Module()
    holder.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    holder.model.layers[0].mlp = torch.nn.Module()
    holder.model.layers[0].mlp.up_proj = lin
    apply_train_precision(holder, Contract("fp8_block", "fp8_block"))
    x = torch.randn(200, 512, device=dev, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(200, 384, device=dev, dtype=torch.bfloat16)
    y = lin(x)  # native
    y.backward(gy)
    native = (y.detach().float(), x.grad.float(), lin.weight.grad.float())
    x.grad, lin.weight.grad = None, None
    wq = qdq(lin.weight.detach(), "fp8_block", "weight")
    y2 = LowPrecLinearFn.apply(x, lin.weight, wq, "fp8_block", False, False)
    y2.backward(gy)
    emulated = (y2.detach().float(), x.grad.float(), lin.weight.grad.float())
    for a, b in zip(native, emulated):
        assert torch.allclose(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())
