"""Compiling Triton kernels for the H100/H200 (sm_90) without a GPU, for the unit tests that check
the generated PTX: Triton's NVIDIA backend ships its own ptxas, so a CPU machine can build cubins.
The compile runs in a fresh Python process: a test module without CUDA runs its kernels under
Triton's interpreter (TRITON_INTERPRET=1), which patches triton.language for the whole process.

`fused_moe_mmas` is meant for that fresh process (the script passed to `run_compiled`); it
imports Triton and the kernels only when called."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest


def ptxas_available() -> bool:
    """Whether Triton's NVIDIA backend with its bundled ptxas is installed."""
    try:
        import triton.backends.nvidia as nv
    except ImportError:
        return False
    return (Path(nv.__file__).parent / "bin" / "ptxas").exists()


def needs_ptxas() -> pytest.MarkDecorator:
    """Skip mark for tests that compile sm_90 cubins."""
    import pytest  # here: milepost.testing's other users need no pytest

    return pytest.mark.skipif(not ptxas_available(),
                              reason="Triton's NVIDIA backend (bundled ptxas) is not installed")


def run_compiled(script: str) -> None:
    """Run `script` in a fresh interpreter without TRITON_INTERPRET; fails with its stderr's tail
    when it exits non-zero (a failed compile or a failed assert in the script)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]


def mma_counts(kern: Any, ptrs: dict[str, str], ints: str, const: dict[str, Any]) -> Counter[str]:
    """Compile `kern` for sm_90 (4 warps, 3 stages) and count its MMA instructions (wgmma and
    mma.sync, with their shapes and types) in the PTX. `ptrs`: pointer arguments and their
    types; `ints`: the i32 arguments' names, space-separated; `const`: the constexpr values."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**ptrs, **dict.fromkeys(ints.split(), "i32"), **dict.fromkeys(const, "constexpr")}
    k = triton.compile(ASTSource(kern, sig, const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 3})
    assert k.asm["cubin"]
    return Counter(re.findall(r"(wgmma\.mma_async\S*|mma\.sync\S*)", k.asm["ptx"]))


def compile_sm90(kern: Any, ptrs: dict[str, str], const: dict[str, Any], num_warps: int,
                  num_stages: int, floats: tuple[str, ...] = (), divisible: tuple[str, ...] = ()) -> Any:
    """Compile `kern` for sm_90. `ptrs`: pointer arguments and their types; `const`: the
    constexpr values; `floats`: fp32 arguments; the others are i32. Pointers, strides and the
    `divisible` integers are marked 16-divisible, as a launch with aligned tensors (and integer
    arguments that Triton specializes) marks them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kern.arg_names
    sig = {n: ptrs.get(n, "constexpr" if n in const else ("fp32" if n in floats else "i32"))
           for n in names}
    div = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
           if n in ptrs or n.startswith("stride") or n in divisible}
    return triton.compile(ASTSource(kern, sig, const, div), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def sm90_sass(kern: Any, ptrs: dict[str, str], const: dict[str, Any], num_warps: int,
              num_stages: int, floats: tuple[str, ...] = ("scale",)) -> str:
    """Compile `kern` for sm_90 (`compile_sm90`) and return its SASS (nvdisasm of the cubin)."""
    import tempfile

    import triton.backends.nvidia as nv

    k = compile_sm90(kern, ptrs, const, num_warps, num_stages, floats)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        return subprocess.run([str(Path(nv.__file__).parent / "bin" / "nvdisasm"), f.name],
                              capture_output=True, text=True, check=True).stdout


def sm90_mma_waits(kern: Any, ptrs: dict[str, str], const: dict[str, Any], divisible: tuple[str, ...],
                   num_warps: int = 4, num_stages: int = 3) -> tuple[Counter[str], Counter[int]]:
    """Compile `kern` for sm_90 (`compile_sm90`) and count, in its PTX, the MMA instructions
    (wgmma and mma.sync with shapes and types) and the `wgmma.wait_group N` waits by N: a wait
    with N > 0 leaves MMAs in flight (the loop overlaps them), N = 0 waits for every one."""
    import re

    ptx = compile_sm90(kern, ptrs, const, num_warps, num_stages, divisible=divisible).asm["ptx"]
    mmas = Counter(re.findall(r"(wgmma\.mma_async\S*|mma\.sync\S*)", ptx))
    waits = Counter(int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx))
    return mmas, waits


def fused_moe_mmas(kind: str, swap: bool, zero: bool) -> tuple[Counter[str], Counter[str]]:
    """(bf16 kernel's, INT4 kernel's) MMA counts for the fused MoE GEMM `kind` ("gate_up" or
    "down") at one tile config (16 x 64 x 128, `swap`: weight rows on the MMA's M side); `zero`:
    the INT4 kernel reads int8 zero points."""
    from milepost.kernels.fused_moe import _down_kernel, _gate_up_kernel
    from milepost.kernels.fused_moe_int4 import _down_w4_kernel, _gate_up_w4_kernel

    common = dict(SORTED="*i32", BLOCK_EXPERT="*i32", TOTAL="*i32")
    c = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "EVEN_K": True, "SWAP": swap}
    z = "*i8" if zero else "*fp32"  # unread without ZERO
    if kind == "gate_up":
        g = {**c, "TOP_K": 8}
        bf16 = mma_counts(_gate_up_kernel, dict(X="*bf16", W13="*bf16", **common, ACT="*bf16"),
                          "n_pairs inter hidden num_m stride_xt stride_we stride_wn stride_at", g)
        int4 = mma_counts(_gate_up_w4_kernel,
                          dict(X="*bf16", W13="*u8", S13="*fp32", Z13=z, **common, ACT="*bf16"),
                          "n_pairs inter hidden num_m n_bytes stride_xt stride_we stride_wn stride_se "
                          "stride_sn stride_at", {**g, "ZERO": zero})
        return bf16, int4
    if kind != "down":
        raise ValueError(f"fused_moe_mmas: kind {kind!r}; expected 'gate_up' or 'down'")
    bf16 = mma_counts(_down_kernel, dict(ACT="*bf16", W2="*bf16", **common, WEIGHTS="*bf16", Y="*bf16"),
                      "n_pairs hidden inter num_m stride_at stride_we stride_wn stride_yp", c)
    int4 = mma_counts(_down_w4_kernel,
                      dict(ACT="*bf16", W2="*u8", S2="*fp32", Z2=z, **common, WEIGHTS="*bf16", Y="*bf16"),
                      "n_pairs hidden inter num_m n_bytes stride_at stride_we stride_wn stride_se "
                      "stride_sn stride_yp", {**c, "ZERO": zero})
    return bf16, int4
