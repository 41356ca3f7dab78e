"""Packed INT4 (the `--precision int4` engines): two's-complement nibbles two a byte, the W4A16
GEMM (milepost/kernels/int4_gemm.py) against dequantize-then-matmul, the engine's packed storage
dequantizing to the trainer's fake-quant weights bit for bit, updates re-packed on arrival, and
the engine's greedy tokens against transformers on the dequantized weights.
Without CUDA the kernels run under Triton's interpreter, in fp32 (the interpreter's bf16 tl.dot
is broken, and its float32 -> bf16 cast truncates); bf16 is checked on the GPU
(tests/gpu/test_int4_cuda.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from safetensors.torch import load_file, save_file

from milepost.engine.weight_update import WeightLoader, WeightUpdateError
from milepost.kernels.int4_gemm import (
    INT4_TABLE,
    W4Config,
    dequantize_int4,
    dequantize_int4_triton,
    int4_linear,
    w4_config,
    w4_rule,
    w4a16_mm,
)
from milepost.lowprec import elements as el
from milepost.lowprec.contract import Contract
from milepost.lowprec.engine_store import QuantizedLinear, store_quantized
from milepost.lowprec.linear import apply_train_precision
from milepost.lowprec.quantize import dequantize, quantize
from milepost.models.registry import load_model
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.hopper_compile import needs_ptxas, run_compiled

torch.set_num_threads(1)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
INT4 = Contract("int4", "int4")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # intermediate 320: down_proj's rows hold two whole groups of 128 and a partial one
    return make_tiny_checkpoint(tmp_path_factory.mktemp("int4") / "m", "qwen3", seed=3,
                                with_tokenizer=False, intermediate_size=320)


def test_nibbles_are_twos_complement_low_first_and_round_trip() -> None:
    v = torch.arange(-8, 8, dtype=torch.int8)
    packed = el.pack_int4(v)
    assert packed.dtype == torch.uint8 and packed.shape == (8,)
    assert packed[0].item() == 0x98  # -8 -> 0b1000 (low), -7 -> 0b1001 (high)
    assert el.pack_int4(torch.tensor([7, -1], dtype=torch.int8)).item() == 0xF7
    assert torch.equal(el.unpack_int4(packed, 16), v)
    odd = torch.tensor([[3, -2, 5], [-8, 7, -1]], dtype=torch.int8)  # an odd K: a zero pad nibble
    assert el.pack_int4(odd).shape == (2, 2) and el.pack_int4(odd)[0, 1].item() == 0x05
    assert torch.equal(el.unpack_int4(el.pack_int4(odd), 3), odd)
    q = quantize(torch.randn(4, 301), "int4")  # the quantizer's values are packed
    assert q.values.dtype == torch.uint8 and q.values.shape == (4, 151) and q.scales.shape == (4, 3)


@pytest.mark.parametrize("m,n,k,cfg", [
    (1, 64, 128, W4Config(16, 32, 1)),  # one decode row, one group
    (5, 200, 704, None),  # the rule's config; N and K not multiples of the blocks
    (20, 130, 257, W4Config(16, 64, 3)),  # two row blocks, an uneven split, an odd K
    (40, 96, 384, W4Config(32, 64, 2)),
    (3, 96, 1024, W4Config(16, 32, 8, 4, 4)),  # the measured table's shape of config: 8 splits
], ids=str)
def test_w4a16_gemm_equals_dequantize_then_matmul(m: int, n: int, k: int, cfg: W4Config | None) -> None:
    """Group scales spanning six orders of magnitude along K and rows at different scales, so a
    scale read from the wrong group or row, or a nibble out of place, shows."""
    g = torch.Generator().manual_seed(m)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 3, k)[None, :]
    w *= torch.logspace(-1, 1, n)[:, None]
    q = quantize(w, "int4")
    assert torch.equal(dequantize_int4(q.values, q.scales, k, torch.float32), dequantize(q))
    x = torch.randn(m, k, generator=g)
    ref = x @ dequantize(q).t()
    y = w4a16_mm(x.to(DEV), q.values.to(DEV), q.scales.to(DEV), k, cfg).cpu()
    tol = (1e-5 if DEV == "cpu" else 1e-4) * ref.abs().amax(1, keepdim=True)
    assert ((y - ref).abs() <= tol).all()
    # The torch path (CPU, prefill M): the dequantized weight itself, so F.linear's exact bits.
    cpu = int4_linear(x, q.values, q.scales, k)
    assert torch.equal(cpu, torch.nn.functional.linear(x, dequantize(q)))


# Compiled for real GPU targets with Triton's bundled ptxas, no GPU needed: in a process of its own,
# since the interpreter (this module's mode without CUDA) patches triton.language globally.
_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from milepost.kernels.int4_gemm import _dequant_kernel, _w4a16_kernel

ints = dict.fromkeys(("M N K KP stride_x stride_w stride_s stride_c stride_p n_kb kb_per").split(), "i32")
for cc in (90,):  # the H200's; sm_80 compiles too (checked by hand, 2026-12-05)
    for x, bm, bn, parts, zero in (("bf16", 16, 64, False, False), ("fp32", 16, 64, True, False),
                                   ("bf16", 16, 64, False, True)):
        sig = {"X": "*" + x, "W": "*u8", "S": "*fp32", "Z": "*i8", "C": "*fp32" if parts else "*" + x,
               **ints, "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "IEEE": "constexpr",
               "PARTS": "constexpr", "ZERO": "constexpr"}
        const = {"BLOCK_M": bm, "BLOCK_N": bn, "IEEE": x == "fp32", "PARTS": parts, "ZERO": zero}
        k = triton.compile(ASTSource(_w4a16_kernel, sig, const), target=GPUTarget("cuda", cc, 32),
                           options={"num_warps": 4 if bm * bn < 64 * 128 else 8, "num_stages": 3})
        assert k.asm["cubin"] and ("mma" in k.asm["ptx"]) == (x != "fp32"), (cc, x, bm, bn)  # ieee: FMA
    sig = {"W": "*u8", "S": "*fp32", "Z": "*i8", "O": "*bf16", "N": "i32", "K": "i32", "KP": "i32",
           "stride_w": "i32", "stride_s": "i32", "stride_o": "i32", "BLOCK_N": "constexpr",
           "ZERO": "constexpr"}
    for zero in (False, True):  # with zero points: AWQ / asymmetric GPTQ served as stored
        k = triton.compile(ASTSource(_dequant_kernel, sig, {"BLOCK_N": 32, "ZERO": zero}),
                           target=GPUTarget("cuda", cc, 32))
        assert "cvt.rn.bf16" in k.asm["ptx"]  # rounded to nearest even, as torch casts
"""


@needs_ptxas()
def test_measured_configs_are_picked_by_m_bucket_and_the_rule_covers_the_rest() -> None:
    assert w4_config(5, 4096, 1024, 132) == INT4_TABLE[(4096, 1024, 8)]  # 5 rows: the 8 bucket
    assert w4_config(300, 4096, 1024, 132) == INT4_TABLE[(4096, 1024, 256)]
    assert w4_config(5, 96, 1024, 132) == w4_rule(5, 96, 1024, 132)  # a shape not measured
    for (n, k, bucket), cfg in INT4_TABLE.items():  # every entry is a config the kernel takes
        assert cfg.block_m in (16, 32, 64) and cfg.block_m >= min(bucket, 64), cfg
        assert cfg.block_n in (32, 64, 128) and 1 <= cfg.split <= k // 128, cfg


def test_kernels_compile_for_hopper_without_a_gpu() -> None:
    """The interpreter does not compile: this does (sm_90 cubins; bf16 on the tensor cores, fp32
    in IEEE FMAs, split parts)."""
    run_compiled(_COMPILE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_dequantization_gives_torchs_bits(dtype: torch.dtype) -> None:
    """The prefill path's weight (CUDA): N not a multiple of the block, an odd K, a partial group.
    Not bf16 here: the interpreter's float32 -> bf16 cast truncates (the GPU's rounds to nearest
    even; tests/gpu/test_int4_cuda.py checks bf16's bits there)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(45, 301, generator=g) * torch.logspace(-3, 3, 301)[None, :]
    q = quantize(w, "int4")
    got = dequantize_int4_triton(q.values.to(DEV), q.scales.to(DEV), 301, dtype).cpu()
    assert torch.equal(got, dequantize_int4(q.values, q.scales, 301, dtype))
    assert torch.equal(got, dequantize(q).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_stores_packed_bytes_that_dequantize_to_the_trainers_weights(
        ckpt: Path, dtype: torch.dtype) -> None:
    model = load_model(ckpt, dtype, "cpu")
    model.fuse_projections()
    store = store_quantized(model, INT4)
    trainer = load_model(ckpt, dtype, "cpu")
    names = apply_train_precision(trainer, INT4)
    assert len(names) == 2 * 7
    for hf in names:
        view = model.weight_view(hf)
        lin = trainer.get_submodule(hf.removesuffix(".weight"))
        n, k = lin.weight.shape
        assert view.dtype == torch.uint8 and view.shape == (n, (k + 1) // 2)
        assert store.hf_shape(view) == (n, k)
        # The contract, bit for bit: the engine's values are the trainer's fake-quant weights.
        assert torch.equal(store.dequantized(view)[0].to(dtype), lin.quantized_weight())
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp.down_proj, QuantizedLinear)
    assert mlp.down_proj.weight_scale.shape == (64, 3)  # K = 320: groups 128, 128, 64
    x = torch.randn(3, 320, dtype=dtype)
    down = trainer.get_submodule("model.layers.0.mlp.down_proj")
    with torch.no_grad():
        assert torch.equal(mlp.down_proj(x), down(x))  # same weights, same F.linear


def test_updates_repack_on_arrival_and_shapes_are_the_hf_tensors(ckpt: Path) -> None:
    model = load_model(ckpt, torch.float32, "cpu")
    model.fuse_projections()
    store = store_quantized(model, INT4)
    sent = {n: t * 1.5 - 0.01 for n, t in load_file(ckpt / "model.safetensors").items()}
    assert WeightLoader(model).from_named(sent.items(), strict_dtype=True) == len(sent)
    for hf in ("model.layers.1.self_attn.v_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        view = model.weight_view(hf)
        q = quantize(sent[hf], "int4")
        assert torch.equal(view, q.values)  # the packed bytes of its own groups
        assert torch.equal(store.dequantized(view)[0], dequantize(q))
    up = "model.layers.0.mlp.up_proj.weight"
    half = torch.zeros(320, 32)  # the packed view's shape is not what a sender sends
    with pytest.raises(WeightUpdateError, match=r"up_proj.weight: shape mismatch, model expects "
                                                r"\[320, 64\], got \[320, 32\]"):
        WeightLoader(model).from_named([(up, half)])


def test_engine_greedy_equals_transformers_on_dequantized_weights(ckpt: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    from milepost.engine.request import Request
    from milepost.engine.sampling import SamplingParams
    from milepost.engine.server_args import ServerArgs
    from milepost.engine.setup import build_engine

    args = ServerArgs(model_path=ckpt, device="cpu", dtype="float32", page_size=4,
                      chunked_prefill_size=8, max_total_tokens=256, quantization="int4").resolved()
    engine = build_engine(args)[0]
    assert engine.runner.model.model.layers[1].self_attn.qkv_proj.weight.dtype == torch.uint8
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (9, 4)]
    got: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.submit(Request(rid=str(i), prompt_ids=p, stop_ids=frozenset(),
                              params=SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True),
                              on_output=lambda o, i=i: got.setdefault(i, []).extend(o.new_token_ids)))
    engine._drain_inbox(block=False)
    while engine.scheduler.has_work:
        engine.step()
    engine._flush()
    sd = load_file(ckpt / "model.safetensors")
    covered = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    sd = {n: dequantize(quantize(t, "int4")) if n.split(".")[-2] in covered else t
          for n, t in sd.items()}
    ref_dir = tmp_path / "deq"
    ref_dir.mkdir()
    save_file(sd, ref_dir / "model.safetensors", metadata={"format": "pt"})
    (ref_dir / "config.json").write_bytes((ckpt / "config.json").read_bytes())
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, attn_implementation="eager").eval()
    plain = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager").eval()
    cfg = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    differs = False
    for i, p in enumerate(prompts):
        with torch.no_grad():
            assert got[i] == ref.generate(torch.tensor([p]), generation_config=cfg)[0, len(p):].tolist()
            differs |= not torch.equal(ref(torch.tensor([p])).logits, plain(torch.tensor([p])).logits)
    assert differs  # the INT4 weights are what the engine ran
