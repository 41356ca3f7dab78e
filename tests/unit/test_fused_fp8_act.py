"""FP8 activations made inside the kernels that make them (milepost/kernels/fused_fp8_act.py): the
fused RMSNorm, residual-add + RMSNorm and SiLU * up give the bytes and scales of the bf16 kernel
followed by `quantize_act_1x128(y, 4)`, and an fp8_block engine (native FP8 linears forced on the
CPU, the GPU inference path's kernels under Triton's interpreter) decodes the same greedy tokens
and log-probs with the fusion on as off, while actually skipping the quantize launches.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from milepost.kernels import fused_ops  # noqa: E402
from milepost.kernels.fp8_quant import quantize_act_1x128  # noqa: E402
from milepost.kernels.fused_fp8_act import add_rms_norm_fp8, rms_norm_fp8, silu_mul_fp8  # noqa: E402
from milepost.lowprec.fp8_act import Fp8Act  # noqa: E402
from milepost.testing.hopper_compile import needs_ptxas, run_compiled  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # silu of large |gate|
torch.set_num_threads(1)
SHAPES = [(1, 640), (7, 1280), (64, 256), (299, 128)]  # rows, K: padding to 4, one to ten blocks


def _rows(t: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows over eight orders of magnitude with columns over two (block scales differ), a zero
    row (amax 0: scale 1) and, with 3+ rows, an Inf (its block: a NaN scale)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * torch.logspace(-4, 4, t)[:, None]
    x = x * torch.logspace(-1, 1, k)[None, :]
    if t >= 3:
        x[1] = 0.0
        x[2, k // 2] = math.inf
    return x.to(dtype).to(DEV)


def _same_bits(a: Fp8Act, y: torch.Tensor) -> None:
    """a is quantize_act_1x128(y, 4) bit for bit: values, scales (NaN ones too), layout."""
    q, s = quantize_act_1x128(y, 4)
    assert a.rows == y.shape[0] and a.dtype == y.dtype
    assert a.values.shape == q.shape and a.scales.shape == s.shape and a.scales.stride() == s.stride()
    assert torch.equal(a.values.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(a.scales.view(torch.int32), s.view(torch.int32))


@pytest.mark.parametrize("t,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_fp8_gives_the_norm_then_quantize_bits(t: int, k: int, dtype: torch.dtype) -> None:
    if dtype == torch.float32 and t > 64:
        pytest.skip("one long shape is enough (interpreter time)")
    x = _rows(t, k, dtype, 0)
    w = torch.logspace(-1, 1, k).to(dtype).to(DEV)
    a = rms_norm_fp8(x, w, 1e-6)
    _same_bits(a, fused_ops.rms_norm(x, w, 1e-6))
    if t >= 3:
        assert torch.isnan(a.scales[2]).any() and (a.scales[1] == 1).all()


@pytest.mark.parametrize("t,k", SHAPES)
def test_add_rms_norm_fp8_gives_the_sum_and_the_quantized_norm(t: int, k: int) -> None:
    x, r = _rows(t, k, torch.bfloat16, 1), _rows(t, k, torch.bfloat16, 2).flip(0)
    w = torch.logspace(1, -1, k).to(torch.bfloat16).to(DEV)
    h, a = add_rms_norm_fp8(x, r, w, 1e-5)
    h_ref, y_ref = fused_ops.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(h.view(torch.int16), h_ref.view(torch.int16))
    _same_bits(a, y_ref)


@pytest.mark.parametrize("t,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_fp8_gives_silu_mul_then_quantize_bits(t: int, k: int, dtype: torch.dtype) -> None:
    if dtype == torch.float32 and t > 64:
        pytest.skip("one long shape is enough (interpreter time)")
    gate_up = torch.cat([_rows(t, k, dtype, 3) * 1e-2, _rows(t, k, dtype, 4)], dim=1)
    gate, up = gate_up.chunk(2, dim=-1)  # row stride 2K, as gate_up_proj's halves
    _same_bits(silu_mul_fp8(gate, up), fused_ops.silu_mul(gate, up))


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("t,k", [(7, 640), (5, 1280)])
def test_norms_split_over_programs_give_the_same_bits(monkeypatch: pytest.MonkeyPatch, t: int, k: int,
                                                      groups: int) -> None:
    """A row split over programs (each redoing the row's reduction; the last one's blocks partly
    past K, e.g. 5 blocks in parts of 2) gives the unsplit bits, h included."""
    from milepost.kernels import fused_fp8_act

    monkeypatch.setattr(fused_fp8_act, "GROUPS_PER_PROGRAM", groups)
    x, r = _rows(t, k, torch.bfloat16, 7), _rows(t, k, torch.bfloat16, 8).flip(0)
    w = torch.logspace(-1, 1, k).to(torch.bfloat16).to(DEV)
    _same_bits(rms_norm_fp8(x, w, 1e-6), fused_ops.rms_norm(x, w, 1e-6))
    h, a = add_rms_norm_fp8(x, r, w, 1e-6)
    h_ref, y_ref = fused_ops.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(h.view(torch.int16), h_ref.view(torch.int16))
    _same_bits(a, y_ref)


@pytest.mark.parametrize("groups", [1, 4])
def test_silu_mul_fp8_blocks_a_program_give_the_same_bits(monkeypatch: pytest.MonkeyPatch,
                                                          groups: int) -> None:
    from milepost.kernels import fused_fp8_act

    monkeypatch.setattr(fused_fp8_act, "SILU_GROUPS_PER_PROGRAM", groups)
    gate, up = torch.cat([_rows(7, 640, torch.bfloat16, 9) * 1e-2, _rows(7, 640, torch.bfloat16, 10)],
                         dim=1).chunk(2, dim=-1)
    _same_bits(silu_mul_fp8(gate, up), fused_ops.silu_mul(gate, up))


@pytest.mark.parametrize("groups", [None, 1, 4])
@pytest.mark.parametrize("t,k,dtype", [(7, 640, torch.bfloat16), (5, 1280, torch.bfloat16),
                                       (5, 384, torch.float32)])
def test_quantize_rows_fp8_gives_quantize_act_bits(monkeypatch: pytest.MonkeyPatch, t: int, k: int,
                                                   dtype: torch.dtype, groups: int | None) -> None:
    from milepost.kernels import fused_fp8_act

    monkeypatch.setattr(fused_fp8_act, "QUANT_GROUPS_PER_PROGRAM", groups)
    x = _rows(t, k, dtype, 11)
    _same_bits(fused_fp8_act.quantize_rows_fp8(x), x)


def test_norm_groups_default_is_four_blocks_within_the_row() -> None:
    """The measured default: 4 blocks a program, never more than the row has."""
    from milepost.kernels import fused_fp8_act

    cpu = torch.device("cpu")
    assert fused_fp8_act._norm_groups(64, 20, cpu) == 4  # 4B hidden: 5 programs a row
    assert fused_fp8_act._norm_groups(256, 8, cpu) == 4  # 0.6B hidden: 2 a row
    assert fused_fp8_act._norm_groups(4, 2, cpu) == 2  # never more than the row


_LAYOUTS = """
import inspect, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from milepost.kernels.fused_ops import _add_rms_norm_kernel, _rms_norm_kernel
from milepost.kernels.fused_fp8_act import _norm_fp8_kernel

def reduced(kern, dtype, const):
    names = list(inspect.signature(kern.fn).parameters)
    ptrs = {n: ("*fp8e4nv" if n == "Q" else "*fp32" if n == "S" else dtype) for n in "XRWHYQS"}
    sig = {n: "constexpr" if n in const else ptrs.get(n, "fp32" if n == "eps" else "i32")
           for n in names}
    div = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)  # as a launch specializes
           if n in ptrs or n in ("stride_x", "stride_r", "stride_h", "stride_y", "stride_q", "n_cols")}
    ttgir = triton.compile(ASTSource(kern, sig, const, div), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4}).asm["ttgir"]
    layouts = dict(re.findall(r"^(#blocked\\d*) = (.*)$", ttgir, re.M))
    sums = re.findall(r"\\}\\) : \\(tensor<(\\d+)xf32, (#blocked\\d*)>\\) -> f32", ttgir)
    assert len(sums) == 1, sums  # the sum of squares: the one full reduction to a scalar
    return sums[0][0], layouts[sums[0][1]]

for dtype in ("*bf16", "*fp32"):
    for k in (1024, 2560, 4096):
        block = triton.next_power_of_2(k)
        for ref, add in ((_rms_norm_kernel, False), (_add_rms_norm_kernel, True)):
            want = reduced(ref, dtype, {"BLOCK": block})
            for rsplit in ((0, 3) if add else (0,)):  # the added rows, or split GEMM parts
                got = reduced(_norm_fp8_kernel, dtype,
                              {"ADD": add, "BLOCK": block, "GROUPS": 8, "RSPLIT": rsplit})
                assert got == want, (dtype, k, add, rsplit, got, want)
print("ok")
"""


@needs_ptxas()
def test_norm_sum_of_squares_reduces_in_the_bf16_kernels_layout() -> None:
    """On the H100 (sm_90) the fused norms' sum of squares is reduced over the same tensor in
    the same register layout as fused_ops' kernels (so in the same order: the same rstd bits),
    though the rest of the kernel works in the quantizer's [blocks, 128] shape."""
    run_compiled(_LAYOUTS)


def test_k_not_whole_blocks_is_refused() -> None:
    x = torch.randn(3, 192, device=DEV)
    with pytest.raises(ValueError, match="K % 128"):
        rms_norm_fp8(x, torch.ones(192, device=DEV), 1e-6)


@pytest.mark.parametrize("backend", ["decode", "stream", "triton", "emulated"])
def test_fp8_act_linear_equals_the_linear_that_quantizes_itself(backend: str) -> None:
    """The same product from the Fp8Act (its padding rows never reach the output) as from the
    bf16 activation quantized inside fp8_block_linear, for each GEMM; N = 384 > one tile."""
    from milepost.kernels.fp8_gemm import fp8_act_linear, fp8_block_linear
    from milepost.lowprec.quantize import quantize

    x = _rows(5, 256, torch.bfloat16, 5)
    w = torch.logspace(-1, 1, 256).to(torch.bfloat16).to(DEV)
    g = torch.Generator().manual_seed(6)
    q = quantize(torch.randn(384, 256, generator=g) * torch.logspace(-2, 0, 256), "fp8_block")
    wv, ws = q.values.to(DEV), q.scales.to(DEV)
    got = fp8_act_linear(rms_norm_fp8(x, w, 1e-6), wv, ws, backend)
    want = fp8_block_linear(fused_ops.rms_norm(x, w, 1e-6), wv, ws, backend)
    assert got.shape == (5, 384) and got.dtype == torch.bfloat16
    assert torch.equal(got.isnan(), want.isnan()) and torch.isnan(got[2]).all()
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


CASES = [("decode", False, True), ("decode", True, True), ("stream", False, True), ("emulated", False, False)]


@pytest.mark.skipif(DEV == "cuda", reason="CPU forcing of the native path (tests/gpu runs the real one)")
@pytest.mark.parametrize("backend,cfg_fused,residual_fused", CASES)
def test_engine_decodes_the_same_with_the_fusion_on_and_off(
        tmp_path, monkeypatch: pytest.MonkeyPatch, backend: str, cfg_fused: bool,
        residual_fused: bool) -> None:
    """Greedy tokens and log-probs of an fp8_block engine (every projection tile-aligned, native
    FP8 linears forced on the CPU) equal with QuantizedLinear.fuse_act_quant on and off. Cases:
    the decode GEMM with its own quantize launch, the decode GEMM quantizing inside itself
    (a fused table config: the Fp8Act path runs it on the given bits instead), the stream-K
    GEMM, the emulated GEMM; with the residual adds inside the norms (DecoderLM.forward) and apart
    (DecoderLayer.forward). Only o_proj's quantize launches are left when the fusion is on."""
    from milepost.engine.server_args import ServerArgs
    from milepost.engine.setup import build_engine
    from milepost.kernels import fp8_decode, fp8_gemm
    from milepost.lowprec import engine_store
    from milepost.lowprec.engine_store import QuantizedLinear
    from milepost.models import layers
    from milepost.testing.checkpoints import make_tiny_checkpoint
    from milepost.testing.engine_greedy import greedy_outputs, random_prompts

    ckpt = make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=3, with_tokenizer=False,
                                hidden_size=128, intermediate_size=256, head_dim=64,
                                num_attention_heads=4, num_key_value_heads=2)
    monkeypatch.setattr(engine_store, "_native", lambda m, fmt, parts: fmt == "fp8_block" and all(
        r % 128 == 0 and n % 128 == 0 for r, n, _ in parts))
    monkeypatch.setattr(fp8_gemm, "block_backend", lambda dev, m=None: backend)
    monkeypatch.setattr(layers, "gpu_inference", lambda x: True)
    monkeypatch.setattr(layers.DecoderLayer, "fuse_residual_norm", residual_fused)
    if cfg_fused:
        rule = fp8_decode.decode_config
        monkeypatch.setattr(fp8_decode, "decode_config",
                            lambda *a: rule(*a)._replace(fused=True, split=2))
    monkeypatch.setattr(fp8_decode, "QUANT_ROWS", False)  # every separate quantize by one name
    launches = {"quantize": 0, "prequantized": 0}

    def counted(fn, key):
        def call(*a, **kw):
            launches[key] += 1
            return fn(*a, **kw)
        return call

    monkeypatch.setattr(fp8_decode, "quantize_act_1x128", counted(fp8_decode.quantize_act_1x128, "quantize"))
    monkeypatch.setattr(fp8_gemm, "quantize_act_1x128", counted(fp8_gemm.quantize_act_1x128, "quantize"))
    monkeypatch.setattr(fp8_gemm, "quantize_rows_fp8", counted(fp8_gemm.quantize_rows_fp8, "quantize"))
    monkeypatch.setattr(fp8_gemm, "fp8_act_linear", counted(fp8_gemm.fp8_act_linear, "prequantized"))
    out, counts = {}, {}
    for fused in (False, True):
        monkeypatch.setattr(QuantizedLinear, "fuse_act_quant", fused)
        launches.update(quantize=0, prequantized=0)
        args = ServerArgs(model_path=ckpt, device="cpu", dtype="float32", page_size=4,
                          quantization="fp8_block", cpu_kv_cache_gb=0.001).resolved()
        engine = build_engine(args)[0]
        try:
            assert all(m.native for m in engine.runner.model.modules() if isinstance(m, QuantizedLinear))
            out[fused] = greedy_outputs(engine, random_prompts((7, 3), seed=1, high=500), 4)
        finally:
            engine.close()
        counts[fused] = dict(launches)
    assert out[True] == out[False]
    assert len(out[True][0][0]) == 4
    # 4 forwards (a prefill, 3 decode steps) x 2 layers: q/k/v, gate/up, down and o_proj
    quantizing = 0 if backend == "decode" and cfg_fused else 1  # a fused config quantizes inside
    assert counts[False] == {"quantize": 8 * 4 * quantizing, "prequantized": 0}
    assert counts[True] == {"quantize": 8 * quantizing, "prequantized": 8 * 3}


@pytest.mark.parametrize("pool", ["half", "fp8"])
def test_decode_attention_quantizes_its_output_for_o_proj(pool: str) -> None:
    """paged_decode(fp8_out=True): the Fp8Act holds quantize_rows_fp8's bits of the output the
    kernel would have stored (each head one 1 x 128 block), empty rows (seq_len 0) zeros with
    scale 1; where `quantizes_out` says no (split ranges, rows not a multiple of 4) the plain
    output comes back."""
    from milepost.kernels import paged_attention as K
    from milepost.kernels.fused_fp8_act import quantize_rows_fp8

    half = torch.bfloat16 if DEV == "cuda" else torch.float16
    kv = half if pool == "half" else torch.float8_e4m3fn
    g = torch.Generator().manual_seed(11)
    b, h, hkv, d, page, ctx = 8, 4, 2, 128, 16, 40
    nb = b * -(-ctx // page)
    kc = torch.randn(nb * page, hkv, d, generator=g).to(kv).to(DEV)
    vc = (torch.randn(nb * page, hkv, d, generator=g) * 3).to(kv).to(DEV)
    q = torch.randn(b, h, d, generator=g).to(half).to(DEV)
    tables = torch.randperm(nb, generator=g).to(torch.int32).view(b, -1).to(DEV)
    lens = torch.tensor([ctx, 1, 0, 17, 40, 3, 0, 9], dtype=torch.int32, device=DEV)
    plain = K.paged_decode(q, kc, vc, tables, lens, d**-0.5, page, 1)
    a = K.paged_decode(q, kc, vc, tables, lens, d**-0.5, page, 1, fp8_out=True)
    want = quantize_rows_fp8(plain.reshape(b, h * d))
    assert isinstance(a, Fp8Act) and a.rows == b and a.dtype == half
    assert torch.equal(a.values.view(torch.uint8), want.values.view(torch.uint8))
    assert torch.equal(a.scales, want.scales) and a.scales.stride() == want.scales.stride()
    assert a.values[2].view(torch.uint8).eq(0).all() and a.scales[2].eq(1).all()
    split = K.paged_decode(q, kc, vc, tables, lens, d**-0.5, page, 2, fp8_out=True)
    odd = K.paged_decode(q[:6], kc, vc, tables[:6], lens[:6], d**-0.5, page, 1, fp8_out=True)
    assert isinstance(split, torch.Tensor) and isinstance(odd, torch.Tensor)
