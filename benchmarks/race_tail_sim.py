"""How often the fused sampler's race method (milepost/kernels/fused_sampler.py, method="race")
draws a long tail of tiny-probability tokens, simulated on the CPU with the kernel's arithmetic:
Triton's fp32 uniform (a 31-bit integer rounded to fp32, times 4.6566127342e-10), q = -log u in
fp32, the winner argmax(e / q). The row: token 0 at logit 0 and the other 151,935 at -18.4
(probability 1.0e-8 each, 1.55e-3 in all); all tail tokens share e, so the tail's best ratio is
e / min q, and min q comes from the largest of 151,935 uniform integers (drawn directly).

    python benchmarks/race_tail_sim.py [--rows 20000000]
"""

from __future__ import annotations

import argparse

import numpy as np

SCALE = np.float32(4.6566127342e-10)  # triton.language.random.uint_to_uniform_float, int32


def fp32_uniform(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32) * SCALE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=20_000_000)
    ap.add_argument("--tail", type=int, default=151_935)
    ap.add_argument("--logit", type=float, default=-18.4)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    e_tail = np.float32(np.exp(a.logit))
    hits, done = 0, 0
    while done < a.rows:
        n = min(2_000_000, a.rows - done)
        top = rng.random(n) ** (1.0 / a.tail)  # the largest of `tail` uniforms, in (0, 1)
        q_min = -np.log(fp32_uniform(np.minimum(np.floor(2**31 * top), 2**31 - 1).astype(np.int64)))
        q0 = -np.log(fp32_uniform(rng.integers(0, 2**31, n)))
        hits += int(((e_tail / q_min) > (np.float32(1.0) / q0)).sum())
        done += n
    p = a.tail * float(e_tail) / (1 + a.tail * float(e_tail))
    print(f"{a.rows} rows: race draws the tail at {hits / a.rows:.3g}, softmax says {p:.3g} "
          f"({p / max(hits / a.rows, 1e-300):.0f}x too rarely)")


if __name__ == "__main__":
    main()
