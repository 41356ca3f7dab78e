"""Measured configs of the decode FP8 GEMM (milepost/kernels/fp8_decode.py `decode_block_mm`).

(N, K, M bucket) -> (block_m, block_n, split, warps, stages, fused, ticket, narrow): the fastest
correct config of `benchmarks/fp8_gemm_sweep.py` on one NVIDIA H200 (torch 2.11, Triton 3.6),
2026-12-04 17:10 UTC, per Qwen3-4B and Qwen3-0.6B projection (qkv, o, gate_up, down); times per
call from CUDA graphs over weights that overflow L2, bf16 cuBLAS beside. The 0.6B gate_up and
down were not reached in that call's time budget: they get the rule. The qkv and o entries at
M = 64 are from the 17:26 UTC `--focus` pass (572 configs at M = 64, more K splits), the configs
the engine benchmark then ran with; the top configs there lay within 2% of each other.
"""

from __future__ import annotations

H200: dict[tuple[int, int, int], tuple[int, int, int, int, int, bool, bool, bool]] = {
    (6144, 2560, 1): (16, 64, 4, 4, 3, False, True, False),  # qwen3-4b qkv: 10.5 us (bf16 11.4)
    (6144, 2560, 8): (16, 64, 4, 4, 3, False, False, False),  # qwen3-4b qkv: 10.8 us (bf16 10.8)
    (6144, 2560, 16): (16, 64, 4, 4, 3, False, False, False),  # qwen3-4b qkv: 10.8 us (bf16 11.0)
    (6144, 2560, 32): (32, 64, 4, 4, 3, False, False, False),  # qwen3-4b qkv: 11.5 us (bf16 11.1)
    (6144, 2560, 64): (64, 64, 4, 4, 3, False, False, False),  # qwen3-4b qkv: 12.7 us (bf16 10.3), 17:26
    (6144, 2560, 128): (64, 64, 1, 4, 4, False, False, False),  # qwen3-4b qkv: 15.2 us (bf16 11.2)
    (6144, 2560, 256): (64, 64, 1, 4, 3, False, False, False),  # qwen3-4b qkv: 18.1 us (bf16 13.7)
    (2560, 4096, 1): (16, 32, 4, 4, 4, False, True, False),  # qwen3-4b o: 9.3 us (bf16 9.5)
    (2560, 4096, 8): (16, 32, 4, 4, 4, False, True, False),  # qwen3-4b o: 10.0 us (bf16 9.6)
    (2560, 4096, 16): (16, 32, 4, 4, 3, False, False, False),  # qwen3-4b o: 10.3 us (bf16 9.7)
    (2560, 4096, 32): (32, 32, 4, 4, 3, False, False, False),  # qwen3-4b o: 11.4 us (bf16 10.0)
    (2560, 4096, 64): (64, 64, 6, 4, 3, False, False, False),  # qwen3-4b o: 11.9 us (bf16 9.6), 17:26
    (2560, 4096, 128): (64, 64, 4, 4, 3, False, False, False),  # qwen3-4b o: 14.3 us (bf16 10.2)
    (2560, 4096, 256): (64, 64, 2, 4, 3, False, False, False),  # qwen3-4b o: 20.5 us (bf16 11.5)
    (19456, 2560, 1): (16, 64, 1, 4, 4, False, False, False),  # qwen3-4b gate_up: 18.4 us (bf16 31.0)
    (19456, 2560, 8): (16, 32, 1, 4, 4, False, False, False),  # qwen3-4b gate_up: 18.9 us (bf16 30.3)
    (19456, 2560, 16): (16, 32, 1, 4, 4, False, False, False),  # qwen3-4b gate_up: 19.1 us (bf16 30.8)
    (19456, 2560, 32): (32, 32, 1, 4, 4, False, False, False),  # qwen3-4b gate_up: 22.2 us (bf16 30.9)
    (19456, 2560, 64): (64, 64, 1, 4, 3, False, False, False),  # qwen3-4b gate_up: 20.2 us (bf16 31.7)
    (19456, 2560, 128): (64, 64, 1, 4, 3, False, False, False),  # qwen3-4b gate_up: 31.2 us (bf16 29.9)
    (19456, 2560, 256): (128, 64, 1, 8, 3, False, False, False),  # qwen3-4b gate_up: 48.5 us (bf16 39.7)
    (2560, 9728, 1): (16, 64, 8, 4, 4, False, True, False),  # qwen3-4b down: 13.8 us (bf16 16.6)
    (2560, 9728, 8): (16, 64, 8, 4, 3, False, False, False),  # qwen3-4b down: 14.5 us (bf16 16.8)
    (2560, 9728, 16): (16, 64, 8, 4, 3, False, False, False),  # qwen3-4b down: 14.9 us (bf16 17.1)
    (2560, 9728, 32): (32, 64, 8, 4, 3, False, False, False),  # qwen3-4b down: 17.1 us (bf16 17.2)
    (2560, 9728, 64): (64, 64, 8, 4, 3, False, False, False),  # qwen3-4b down: 18.2 us (bf16 17.9)
    (2560, 9728, 128): (64, 64, 4, 4, 3, False, False, False),  # qwen3-4b down: 24.3 us (bf16 20.4)
    (2560, 9728, 256): (64, 64, 2, 4, 3, False, False, False),  # qwen3-4b down: 39.6 us (bf16 27.8)
    (4096, 1024, 1): (16, 32, 1, 4, 6, False, False, False),  # qwen3-0.6b qkv: 6.5 us (bf16 5.2)
    (4096, 1024, 8): (16, 32, 1, 4, 6, False, False, False),  # qwen3-0.6b qkv: 7.0 us (bf16 5.3)
    (4096, 1024, 16): (16, 32, 1, 4, 6, False, False, False),  # qwen3-0.6b qkv: 7.1 us (bf16 5.2)
    (4096, 1024, 32): (32, 32, 1, 4, 6, False, False, False),  # qwen3-0.6b qkv: 7.5 us (bf16 5.3)
    (4096, 1024, 64): (64, 64, 1, 4, 6, False, False, False),  # qwen3-0.6b qkv: 7.3 us (bf16 5.3)
    (4096, 1024, 128): (64, 64, 1, 4, 6, False, False, False),  # qwen3-0.6b qkv: 7.6 us (bf16 5.3)
    (4096, 1024, 256): (64, 64, 1, 4, 3, False, False, False),  # qwen3-0.6b qkv: 9.0 us (bf16 6.3)
    (1024, 2048, 1): (16, 32, 8, 4, 4, False, True, False),  # qwen3-0.6b o: 6.5 us (bf16 12.2)
    (1024, 2048, 8): (16, 32, 8, 4, 3, False, True, False),  # qwen3-0.6b o: 7.0 us (bf16 5.9)
    (1024, 2048, 16): (16, 32, 4, 4, 6, False, True, False),  # qwen3-0.6b o: 7.1 us (bf16 5.9)
    (1024, 2048, 32): (32, 32, 8, 4, 3, False, False, False),  # qwen3-0.6b o: 7.6 us (bf16 5.9)
    (1024, 2048, 64): (64, 64, 4, 4, 6, False, False, False),  # qwen3-0.6b o: 7.8 us (bf16 5.8)
    (1024, 2048, 128): (64, 64, 4, 4, 6, False, False, False),  # qwen3-0.6b o: 8.9 us (bf16 6.0)
    (1024, 2048, 256): (64, 64, 4, 4, 4, False, False, False),  # qwen3-0.6b o: 11.2 us (bf16 6.4)
}
