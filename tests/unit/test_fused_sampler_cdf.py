"""The fused sampler's inverse-CDF method (milepost/kernels/fused_sampler_cdf.py) under Triton's
interpreter on CPU (TRITON_INTERPRET, set before triton is imported).

Exactness is checked draw by draw, not only in distribution: each row's two uniforms are
recomputed from its seed (the same Philox call the kernel makes) and the token must be the one an
fp64 inverse CDF of softmax(logits / T) gives for them: chunk by chunk masses, then token by the
chunk's cumulative sum. The pick itself resolves masses far below fp32's 2^-24 (a token of mass
1e-9 next to one of mass 1 is drawn exactly where its interval lies). Plus edge cases (one token
with all the mass, -inf logits and a whole -inf chunk, T = 1e-4 and 1e3, greedy rows mixed in, a
vocabulary that is not a multiple of the chunk) and a chi-square over several chunks; and both
kernels compile for sm_90 (fp32 and bf16 logits) with Triton's bundled ptxas, no GPU needed.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import (conftest sets it too)
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from milepost.kernels.fused_sampler import fused_sample  # noqa: E402
from milepost.kernels.fused_sampler_cdf import _pick, _uniform53  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CHUNK = 16  # small chunks: a 50-token vocabulary is 4 of them, the last one partial


@triton.jit
def _uniforms_probe(SEED, OUT):
    """The kernel's Philox call for one row: the four uint32 and the two uniforms it makes."""
    i = tl.program_id(0)
    a, b, c, d = tl.randint4x(tl.load(SEED + i), tl.full((), 0, tl.int32))
    tl.store(OUT + 6 * i, a.to(tl.int64))
    tl.store(OUT + 6 * i + 1, b.to(tl.int64))
    tl.store(OUT + 6 * i + 2, c.to(tl.int64))
    tl.store(OUT + 6 * i + 3, d.to(tl.int64))
    tl.store(OUT + 6 * i + 4, _uniform53(a, b).to(tl.int64, bitcast=True))
    tl.store(OUT + 6 * i + 5, _uniform53(c, d).to(tl.int64, bitcast=True))


@triton.jit
def _pick_probe(W, U, OUT, N: tl.constexpr):
    i = tl.program_id(0)
    w = tl.load(W + i * N + tl.arange(0, N)).to(tl.float64)
    tl.store(OUT + i, _pick(w, tl.load(U + i), N))


def row_uniforms(seeds: torch.Tensor) -> tuple[list[float], list[float], torch.Tensor]:
    """(u0, u1) per seed computed here from the Philox words, and the kernel's own (u0, u1)."""
    out = torch.zeros(len(seeds) * 6, dtype=torch.int64, device=DEV)
    _uniforms_probe[(len(seeds),)](seeds.to(DEV), out)
    words = out.view(-1, 6).cpu()
    mine = [[((int(r[0]) >> 5) * 2**26 + (int(r[1]) >> 6)) / 2**53,
             ((int(r[2]) >> 5) * 2**26 + (int(r[3]) >> 6)) / 2**53] for r in words]
    return [m[0] for m in mine], [m[1] for m in mine], words[:, 4:].contiguous().view(torch.float64)


def pick64(w: torch.Tensor, u: float) -> int:
    """The first entry whose inclusive cumulative sum exceeds u * total (fp64 reference)."""
    cw = torch.cumsum(w, 0)
    return int(((cw > u * cw[-1]) & (w > 0)).nonzero()[0])


def reference_token(x: torch.Tensor, t: float, u0: float, u1: float) -> int:
    """Inverse CDF of softmax(x / t) in fp64, chunk by mass, then token within the chunk."""
    x = x.double()
    masses = torch.stack([torch.exp((x[i:i + CHUNK] - x.max()) / t).sum()
                          for i in range(0, len(x), CHUNK)])
    c = pick64(masses, u0)
    xc = x[c * CHUNK:(c + 1) * CHUNK]
    return c * CHUNK + pick64(torch.exp((xc - xc.max()) / t), u1)


@pytest.fixture(scope="module")
def drawn() -> dict:
    """128 rows of 50 logits: varied temperatures, -inf entries and a whole -inf chunk."""
    g = torch.Generator().manual_seed(3)
    n, v = 128, 50
    logits = torch.randn(n, v, generator=g) * 2
    logits[::3, 20:36] = float("-inf")  # every third row: chunk 1 has no mass at all
    logits[1::4, 7] = float("-inf")
    temps = torch.tensor([0.05, 0.3, 0.7, 1.0, 2.5, 1e3, 1e-4, 1.0])[torch.arange(n) % 8]
    seeds = torch.randint(0, 2**62, (n,), generator=g)
    tok, lp = fused_sample(logits.to(DEV), temps.to(DEV), torch.zeros(n, dtype=torch.int8, device=DEV),
                           seeds.to(DEV), splits=2, method="cdf", chunk=CHUNK)
    u0, u1, kernel_u = row_uniforms(seeds)
    ref = [reference_token(logits[i], float(temps[i]), u0[i], u1[i]) for i in range(n)]
    lse = torch.logsumexp(logits.double() / temps.double()[:, None], -1)
    want_lp = logits.double().gather(1, tok.cpu()[:, None]).squeeze(1) / temps.double() - lse
    return {"tok": tok.cpu(), "ref": torch.tensor(ref), "lp": lp.cpu().double(), "want_lp": want_lp,
            "u": (u0, u1), "kernel_u": kernel_u, "logits": logits}


def test_each_token_is_the_inverse_cdf_of_its_uniforms(drawn: dict) -> None:
    assert torch.equal(drawn["tok"], drawn["ref"]), (drawn["tok"], drawn["ref"])
    # the reference's uniforms are the kernel's: 53-bit, in [0, 1), not on fp32's 2^-24 grid
    u = torch.tensor(drawn["u"], dtype=torch.float64).T
    assert torch.equal(drawn["kernel_u"], u)
    assert (u >= 0).all() and (u < 1).all()
    assert ((u * 2**24) % 1 != 0).float().mean() > 0.9


def test_never_a_masked_token_and_exact_logprobs(drawn: dict) -> None:
    tok, logits = drawn["tok"], drawn["logits"]
    assert torch.isfinite(logits.gather(1, tok[:, None])).all()
    assert (drawn["lp"] - drawn["want_lp"]).abs().max() < 1e-5
    assert len(set(tok.tolist())) > 20  # the check above is over many different tokens


def test_pick_resolves_masses_below_fp32_precision() -> None:
    """w = [1, 1e-9 x 7, 0, 1e-9 x 7]: a u inside each tiny interval picks that token; the
    zero-mass entry is never picked, not even at u just below 1 (the last positive one is)."""
    n = 16
    w = torch.full((n,), 1e-9, dtype=torch.float32)
    w[0], w[8] = 1.0, 0.0
    cw = torch.cumsum(w.double(), 0)
    total = float(cw[-1])
    us, want = [0.5, 1 - 2**-53], [0, 15]
    for k in range(1, n):
        if w[k] > 0:  # the middle of token k's interval, as a fraction of the total
            us.append(float((cw[k - 1] + cw[k]) / 2 / total))
            want.append(k)
    assert min(us[2:]) > 1 - 2**-24  # all inside fp32's last step below 1: no fp32 u could pick them
    out = torch.zeros(len(us), dtype=torch.int32, device=DEV)
    _pick_probe[(len(us),)](w.repeat(len(us), 1).to(DEV), torch.tensor(us, dtype=torch.float64, device=DEV),
                            out, N=n)
    assert out.cpu().tolist() == want


def test_edge_rows() -> None:
    """One token with all the mass (others -inf, or 100 below), T = 1e-4 with a clear maximum,
    greedy rows between sampled ones (first maximum, log-prob at T = 1), one-token vocabulary."""
    v = 37
    rows = torch.zeros(6, v)
    rows[0] = float("-inf")
    rows[0, 30] = 0.5  # the only finite logit
    rows[1, 33] = 100.0  # the rest 100 below: exp(-100) of mass
    rows[2] = torch.linspace(-3, 3, v)  # T = 1e-4: the last token, by 6 / 36 / 1e-4 nats
    rows[3] = torch.linspace(3, -3, v)
    rows[3, 17] = rows[3, 20] = 4.0  # greedy, tied: the first
    rows[4] = torch.randn(v)
    rows[5] = torch.randn(v)
    rows[5, 2] = rows[5].max() + 1.0  # greedy
    temps = torch.tensor([0.7, 1.0, 1e-4, 1.0, 1.3, 1.0])
    greedy = torch.tensor([0, 0, 0, 1, 0, 1], dtype=torch.int8)
    for seed in range(3):
        seeds = torch.randint(0, 2**62, (6,), generator=torch.Generator().manual_seed(seed))
        tok, lp = fused_sample(rows.to(DEV), temps.to(DEV), greedy.to(DEV), seeds.to(DEV),
                               method="cdf", chunk=CHUNK)
        tok, lp = tok.cpu(), lp.cpu()
        assert tok[[0, 1, 2, 3, 5]].tolist() == [30, 33, 36, 17, 2]
        assert lp[:3].abs().max() < 1e-6  # log 1
        ref = torch.log_softmax(rows.double() / temps.double()[:, None], -1).gather(1, tok[:, None])
        assert (lp.double() - ref.squeeze(1)).abs().max() < 1e-5
    one = fused_sample(torch.zeros(3, 1, device=DEV), torch.ones(3, device=DEV),
                       torch.zeros(3, dtype=torch.int8, device=DEV),
                       torch.arange(3, device=DEV), method="cdf")
    assert one[0].tolist() == [0, 0, 0] and one[1].abs().max() < 1e-6


@pytest.mark.parametrize("method", ["race", "cdf"])
def test_bf16_logits_draw_what_their_fp32_values_draw(method: str) -> None:
    """The engine's decode graphs hand the sampler bf16 logits; the kernels read them as fp32."""
    g = torch.Generator().manual_seed(6)
    logits = (torch.randn(8, 37, generator=g) * 3).bfloat16()
    temps, greedy = torch.full((8,), 0.8), torch.zeros(8, dtype=torch.int8)
    temps[0], greedy[0] = 1.0, 1
    seeds = torch.randint(0, 2**62, (8,), generator=g)
    args = [t.to(DEV) for t in (temps, greedy, seeds)]
    tok, lp = fused_sample(logits.to(DEV), *args, method=method, chunk=CHUNK)
    tok32, lp32 = fused_sample(logits.float().to(DEV), *args, method=method, chunk=CHUNK)
    assert torch.equal(tok, tok32) and torch.equal(lp, lp32)


def test_draws_follow_softmax_across_chunks() -> None:
    """600 draws (one row each) of 40 logits in 3 chunks (the last one partial), T = 0.9."""
    from tests.unit.test_fused_sampler import chi_square_p

    n = 600
    base = torch.full((40,), -1.0)
    base[[2, 5, 17, 20, 33, 39]] = torch.tensor([1.0, 0.2, 0.8, -0.2, 1.2, 0.0])
    base[10] = float("-inf")
    # expand: n rows reading one row (stride 0), as the GPU test's 400,000-row draws do
    tok = fused_sample(base.to(DEV).expand(n, -1), torch.full((n,), 0.9, device=DEV),
                       torch.zeros(n, dtype=torch.int8, device=DEV),
                       torch.randint(0, 2**62, (n,), generator=torch.Generator().manual_seed(5)).to(DEV),
                       splits=4, method="cdf", chunk=CHUNK)[0].cpu()
    counts = torch.bincount(tok, minlength=40)
    assert counts[10] == 0
    p = torch.softmax(base.double() / 0.9, 0)
    big = [2, 5, 17, 20, 33, 39]
    rest = [i for i in range(40) if i not in big]
    got = counts[big].tolist() + [int(counts[rest].sum())]
    want = (torch.cat([p[big], p[rest].sum()[None]]) * n).tolist()
    assert min(want) > 5  # chi-square's usual condition
    assert chi_square_p(got, want) > 1e-4, (got, want)
    # the test can fail: the same counts against the distribution at T = 2
    p2 = torch.softmax(base.double() / 2.0, 0)
    assert chi_square_p(got, (torch.cat([p2[big], p2[rest].sum()[None]]) * n).tolist()) < 1e-4
    assert math.isclose(sum(want), n)


COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from milepost.kernels import fused_sampler_cdf as C
common = {"TEMP": "*fp32", "GREEDY": "*i8", "M": "*fp32", "S": "*fp32", "ARG": "*i32",
          "n_vocab": "i32", "n_chunks": "i32", "stride_z": "i32", "stride_c": "i32"}
for dt in ("*fp32", "*bf16"):
    for fn, extra, const in (
            (C._chunk_stats, {}, {"SPLITS": 32, "CHUNK": 2048}),
            (C._select, {"SEED": "*i64", "TOK": "*i64", "LOGP": "*fp32"}, {"NCP": 128, "CHUNK": 2048})):
        names = fn.arg_names
        types = {"Z": dt, **common, **extra, **{k: "constexpr" for k in const}}
        src = ASTSource(fn=fn, signature={n: types[n] for n in names}, constexprs=const)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert k.asm["cubin"], fn
print("compiled")
"""


def test_kernels_compile_for_sm90(tmp_path: Path) -> None:
    """The GPU is not here: compile the kernels ahead of time for an H100/H200 (sm_90), in a
    process without the interpreter, so a type or lowering error (fp64 scans, the if/else
    branches' values) shows on the CPU first."""
    import triton as tr

    if not (Path(tr.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path),
           "TRITON_DEFAULT_FP_FUSION": "1"}
    out = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
