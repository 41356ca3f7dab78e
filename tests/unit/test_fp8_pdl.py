"""Programmatic dependent launch through an FP8 decode step (fp8_quant.PDL): the activation
kernels trigger their dependents, the decode GEMM prefetches its weight rows into L2 and waits.
Off the GPU nothing changes (no option is passed); on sm_90 the kernels compile with the
instructions in place. Timed and checked on a GPU by benchmarks/lowprec_gpu.py
(--modes fp8_block+fp8_kv_pdl) and tests/gpu/test_fp8_pdl_cuda.py."""

from __future__ import annotations

import pytest
import torch

from milepost.kernels import fp8_decode, fp8_quant
from milepost.testing.hopper_compile import needs_ptxas, run_compiled


def test_no_early_launch_off_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8_quant, "PDL", True)
    cpu = torch.device("cpu")
    assert not fp8_quant.pdl_supported(cpu)
    assert fp8_quant.early_launch(cpu) == {}
    cfg = fp8_decode.DecodeConfig(16, 64, 2, 4, 3, False, pdl=True)
    assert not fp8_decode._pdl(cfg, torch.zeros(1))


_COMPILE_PDL = """
import re
from milepost.kernels import fp8_decode, fused_fp8_act
from milepost.testing.hopper_compile import compile_sm90

ptrs = dict(X="*fp8e4nv", SX="*fp32", W="*fp8e4nv", SW="*fp32", C="*bf16", P="*fp32", CNT="*i32")
const = dict(BLOCK_M=16, BLOCK_N=64, FUSED=False, MODE=1, QROWS=16, PDL=True, PREFETCH=True)
ptx = compile_sm90(fp8_decode._decode_kernel, ptrs, const, 4, 3).asm["ptx"]
prefetch = ptx.find("cp.async.bulk.prefetch.L2.global")
wait = ptx.find("griddepcontrol.wait")
assert 0 <= prefetch < wait, (prefetch, wait)  # the weights are asked for before the wait
assert "ld.global" not in ptx[:wait]  # nothing else is loaded before it
plain = compile_sm90(fp8_decode._decode_kernel, ptrs, {**const, "PDL": False}, 4, 3).asm["ptx"]
assert "griddepcontrol" not in plain and "prefetch" not in plain
bare = compile_sm90(fp8_decode._decode_kernel, ptrs, {**const, "PREFETCH": False}, 4, 3).asm["ptx"]
assert "griddepcontrol.wait" in bare and "prefetch" not in bare  # fp8_decode.PDL_PREFETCH off

q = dict(Q="*fp8e4nv", S="*fp32")
for kern, p, c in (
        (fused_fp8_act._norm_fp8_kernel, dict(X="*bf16", R="*bf16", W="*bf16", H="*bf16", **q),
         dict(ADD=True, BLOCK=4096, GROUPS=4, RSPLIT=0)),
        (fused_fp8_act._silu_mul_fp8_kernel, dict(G="*bf16", U="*bf16", **q), dict(GROUPS=4)),
        (fused_fp8_act._quant_rows_kernel, dict(X="*bf16", **q), dict(GROUPS=8))):
    on = compile_sm90(kern, p, {**c, "TRIGGER": True}, 4, 1, floats=("eps",)).asm["ptx"]
    off = compile_sm90(kern, p, {**c, "TRIGGER": False}, 4, 1, floats=("eps",)).asm["ptx"]
    assert "griddepcontrol.launch_dependents" in on and "griddepcontrol" not in off, kern
"""


@needs_ptxas()
def test_the_early_launch_kernels_compile_for_sm90() -> None:
    """The GEMM asks L2 for its weight rows before griddepcontrol.wait and loads nothing else
    before it; the three activation kernels trigger their dependents; without the options the
    same kernels have none of it."""
    run_compiled(_COMPILE_PDL)
