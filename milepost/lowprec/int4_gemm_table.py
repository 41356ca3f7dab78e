"""Measured configs of the W4A16 decode GEMM (milepost/kernels/int4_gemm.py `w4a16_mm`).

(N, K, M bucket) -> (block_m, block_n, split, warps, stages): the fastest config of
`benchmarks/lowprec_gpu.py --parts int4` (each config checked against the dequantized product
first, then timed over enough weight copies to overflow L2) on one NVIDIA H100 80GB HBM3, torch
2.11, Triton 3.6, 2026-12-06 07:2x UTC, per Qwen3-0.6B and Qwen3-4B projection (qkv, o, gate_up,
down). Per layer the four took, against int4_gemm's rule: 0.6B 25.1 vs 32.6 us at M = 1, 34.5 vs
44.9 at 64, 55.4 vs 57.2 at 256; 4B 65.2 vs 74.2 at M = 1, 93.9 vs 97.8 at 64, 245.7 vs 275.5 at
256 (bf16 cuBLAS: 25.0 / 27.2 / 31.3 and 86.5 / 88.5 / 108.5). A shape not listed gets the rule.
Split configs were timed with their parts summed by torch (a sum, then a cast: two launches);
`w4a16_mm` sums them in one launch since (fp8_decode.sum_split_parts), not yet timed. Not yet
re-run inside the engine.
"""

from __future__ import annotations

H100: dict[tuple[int, int, int], tuple[int, int, int, int, int]] = {
    (4096, 1024, 1): (16, 32, 1, 4, 4),  # qwen3-0.6b qkv: 4.7 us (rule 7.2, bf16 5.3)
    (4096, 1024, 8): (16, 32, 1, 4, 4),  # qwen3-0.6b qkv: 4.8 us (rule 8.4, bf16 5.7)
    (4096, 1024, 16): (16, 32, 1, 4, 4),  # qwen3-0.6b qkv: 4.8 us (rule 8.8, bf16 5.8)
    (4096, 1024, 32): (32, 32, 1, 4, 3),  # qwen3-0.6b qkv: 6.8 us (rule 9.7, bf16 5.9)
    (4096, 1024, 64): (64, 32, 1, 4, 4),  # qwen3-0.6b qkv: 7.1 us (rule 11.2, bf16 6.1)
    (4096, 1024, 128): (64, 32, 1, 4, 3),  # qwen3-0.6b qkv: 8.8 us (rule 14.1, bf16 6.3)
    (4096, 1024, 256): (64, 64, 1, 4, 3),  # qwen3-0.6b qkv: 12.2 us (rule 12.2, bf16 7.3)
    (1024, 2048, 1): (16, 32, 1, 4, 4),  # qwen3-0.6b o: 6.8 us (rule 7.4, bf16 5.8)
    (1024, 2048, 8): (16, 32, 1, 4, 4),  # qwen3-0.6b o: 6.8 us (rule 7.6, bf16 5.8)
    (1024, 2048, 16): (16, 32, 1, 4, 4),  # qwen3-0.6b o: 6.8 us (rule 7.8, bf16 5.8)
    (1024, 2048, 32): (32, 64, 8, 4, 3),  # qwen3-0.6b o: 8.1 us (rule 8.1, bf16 5.8)
    (1024, 2048, 64): (64, 32, 8, 4, 3),  # qwen3-0.6b o: 9.0 us (rule 9.2, bf16 6.0)
    (1024, 2048, 128): (64, 32, 4, 4, 3),  # qwen3-0.6b o: 10.5 us (rule 10.7, bf16 6.1)
    (1024, 2048, 256): (64, 32, 1, 4, 4),  # qwen3-0.6b o: 11.4 us (rule 13.2, bf16 6.4)
    (6144, 1024, 1): (16, 32, 1, 4, 4),  # qwen3-0.6b gate_up: 6.0 us (rule 9.7, bf16 7.1)
    (6144, 1024, 8): (16, 32, 1, 4, 4),  # qwen3-0.6b gate_up: 6.0 us (rule 10.0, bf16 7.2)
    (6144, 1024, 16): (16, 32, 1, 4, 4),  # qwen3-0.6b gate_up: 6.0 us (rule 10.4, bf16 7.3)
    (6144, 1024, 32): (32, 64, 1, 4, 3),  # qwen3-0.6b gate_up: 8.3 us (rule 12.0, bf16 7.4)
    (6144, 1024, 64): (64, 32, 1, 4, 3),  # qwen3-0.6b gate_up: 8.9 us (rule 14.2, bf16 7.8)
    (6144, 1024, 128): (64, 32, 1, 4, 3),  # qwen3-0.6b gate_up: 11.5 us (rule 12.2, bf16 7.8)
    (6144, 1024, 256): (64, 64, 1, 4, 3),  # qwen3-0.6b gate_up: 16.3 us (rule 16.3, bf16 8.6)
    (1024, 3072, 1): (16, 32, 8, 4, 3),  # qwen3-0.6b down: 7.6 us (rule 8.3, bf16 6.8)
    (1024, 3072, 8): (16, 32, 8, 4, 3),  # qwen3-0.6b down: 7.8 us (rule 8.6, bf16 7.0)
    (1024, 3072, 16): (16, 32, 8, 4, 4),  # qwen3-0.6b down: 7.9 us (rule 8.7, bf16 7.1)
    (1024, 3072, 32): (32, 64, 8, 4, 3),  # qwen3-0.6b down: 8.7 us (rule 9.2, bf16 7.2)
    (1024, 3072, 64): (64, 32, 8, 4, 3),  # qwen3-0.6b down: 9.6 us (rule 10.4, bf16 7.4)
    (1024, 3072, 128): (64, 64, 8, 4, 3),  # qwen3-0.6b down: 11.6 us (rule 11.6, bf16 7.7)
    (1024, 3072, 256): (64, 64, 4, 4, 3),  # qwen3-0.6b down: 15.5 us (rule 15.4, bf16 8.9)
    (6144, 2560, 1): (16, 32, 1, 4, 4),  # qwen3-4b qkv: 11.6 us (rule 14.9, bf16 14.1)
    (6144, 2560, 8): (16, 32, 1, 4, 4),  # qwen3-4b qkv: 11.6 us (rule 15.1, bf16 14.3)
    (6144, 2560, 16): (16, 32, 1, 4, 4),  # qwen3-4b qkv: 11.6 us (rule 15.7, bf16 14.5)
    (6144, 2560, 32): (32, 64, 4, 4, 4),  # qwen3-4b qkv: 15.7 us (rule 18.0, bf16 14.8)
    (6144, 2560, 64): (64, 32, 1, 4, 4),  # qwen3-4b qkv: 17.6 us (rule 21.4, bf16 14.3)
    (6144, 2560, 128): (64, 32, 1, 4, 3),  # qwen3-4b qkv: 24.7 us (rule 26.4, bf16 14.7)
    (6144, 2560, 256): (64, 64, 1, 4, 3),  # qwen3-4b qkv: 35.7 us (rule 35.7, bf16 16.4)
    (2560, 4096, 1): (16, 32, 8, 4, 4),  # qwen3-4b o: 11.4 us (rule 12.0, bf16 11.4)
    (2560, 4096, 8): (16, 32, 8, 4, 4),  # qwen3-4b o: 11.2 us (rule 12.1, bf16 11.6)
    (2560, 4096, 16): (16, 32, 8, 4, 4),  # qwen3-4b o: 11.3 us (rule 12.2, bf16 11.8)
    (2560, 4096, 32): (32, 64, 8, 4, 3),  # qwen3-4b o: 13.5 us (rule 13.6, bf16 12.0)
    (2560, 4096, 64): (64, 64, 6, 4, 4),  # qwen3-4b o: 15.9 us (rule 16.0, bf16 11.0)
    (2560, 4096, 128): (64, 64, 3, 4, 4),  # qwen3-4b o: 22.0 us (rule 22.1, bf16 11.6)
    (2560, 4096, 256): (64, 64, 4, 4, 3),  # qwen3-4b o: 34.3 us (rule 39.8, bf16 13.6)
    (19456, 2560, 1): (16, 32, 1, 4, 4),  # qwen3-4b gate_up: 24.2 us (rule 26.8, bf16 38.4)
    (19456, 2560, 8): (16, 32, 1, 4, 4),  # qwen3-4b gate_up: 24.7 us (rule 27.5, bf16 39.0)
    (19456, 2560, 16): (16, 32, 1, 4, 4),  # qwen3-4b gate_up: 24.4 us (rule 27.2, bf16 39.4)
    (19456, 2560, 32): (32, 64, 1, 4, 3),  # qwen3-4b gate_up: 33.7 us (rule 33.9, bf16 41.8)
    (19456, 2560, 64): (64, 64, 1, 4, 3),  # qwen3-4b gate_up: 36.3 us (rule 36.2, bf16 40.0)
    (19456, 2560, 128): (64, 64, 1, 4, 3),  # qwen3-4b gate_up: 57.8 us (rule 58.4, bf16 43.0)
    (19456, 2560, 256): (64, 64, 1, 4, 3),  # qwen3-4b gate_up: 110.6 us (rule 110.8, bf16 47.7)
    (2560, 9728, 1): (16, 64, 6, 4, 4),  # qwen3-4b down: 18.0 us (rule 20.4, bf16 22.6)
    (2560, 9728, 8): (16, 32, 8, 4, 4),  # qwen3-4b down: 17.7 us (rule 18.1, bf16 21.8)
    (2560, 9728, 16): (16, 32, 8, 4, 4),  # qwen3-4b down: 17.7 us (rule 18.2, bf16 22.0)
    (2560, 9728, 32): (32, 64, 6, 4, 3),  # qwen3-4b down: 20.3 us (rule 20.2, bf16 22.5)
    (2560, 9728, 64): (64, 64, 6, 4, 4),  # qwen3-4b down: 24.1 us (rule 24.2, bf16 23.2)
    (2560, 9728, 128): (64, 64, 8, 4, 3),  # qwen3-4b down: 38.1 us (rule 39.3, bf16 26.2)
    (2560, 9728, 256): (64, 64, 4, 4, 3),  # qwen3-4b down: 65.1 us (rule 89.2, bf16 30.8)
}
