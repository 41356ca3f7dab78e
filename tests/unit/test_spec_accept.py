"""kernels/spec_accept.py under Triton's interpreter: the verifier with its accepted prefixes and
kept tokens computed by the two kernels returns what the torch ops return, for greedy, sampled
(n-gram point masses) and draft-model proposals, requests without proposals among them."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import (conftest sets it too)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import milepost.engine.speculative_sampling as ss  # noqa: E402
from milepost.engine.sampling_params import SamplingParams  # noqa: E402
from milepost.testing.hopper_compile import needs_ptxas, run_compiled  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
V = 40


def case(kind: str, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    lens = [0, 0] if kind == "none" else [3, 0, 1, 3, 2, 3]
    logits = torch.randn(sum(n + 1 for n in lens), V, generator=g) * 3
    argmax = logits.argmax(dim=-1).tolist()
    drafts, start = [], 0
    for i, n in enumerate(lens):  # some proposals are the argmax (accepted when greedy), some not
        drafts.append([argmax[start + j] if (i + j) % 3 else (argmax[start + j] + 1) % V
                       for j in range(n)])
        start += n + 1
    probs = [None] * len(lens)
    if kind == "model":
        probs = [torch.softmax(torch.randn(n, V, generator=g), dim=-1) if n else None for n in lens]
    params = [SamplingParams(temperature=0.0) if kind == "greedy" or i % 2 else
              SamplingParams(temperature=0.8, top_k=10) for i in range(len(lens))]
    return logits, drafts, probs, params


@pytest.mark.parametrize("kind", ["greedy", "ngram", "model", "none"])
def test_kernels_give_the_torch_path_results(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    logits, drafts, probs, params = case(kind)
    out = {}
    for kernels in (False, True):
        monkeypatch.setattr(ss, "DEVICE_KERNELS", kernels)
        gens = [torch.Generator(device=DEV).manual_seed(7) for _ in params]
        v = ss.verify(logits.to(DEV), drafts, [p if p is None else p.to(DEV) for p in probs],
                      params, gens)
        out[kernels] = (v.tokens, v.accepted, v.logprobs, v.rows)
    assert out[True] == out[False]
    if kind == "greedy":  # every request stops at its first non-argmax proposal
        assert out[True][1] == [0, 0, 1, 0, 2, 1]


_COMPILE = """
from milepost.kernels.spec_accept import _accepted_kernel, _kept_kernel
from milepost.testing.hopper_compile import compile_sm90

i64 = dict(TOKS="*i64", ARGMAX="*i64", OFFS="*i64", LENS="*i64", STARTS="*i64", M="*i64", LAST="*i64")
k = compile_sm90(_accepted_kernel, dict(OK="*i1", **i64), dict(HAS_OK=True, KP=4), 1, 1)
assert k.asm["cubin"]
ptrs = dict(M="*i64", TOKS="*i64", OFFS="*i64", STARTS="*i64", FINAL="*i64", ARGMAX="*i64",
            LP_ALL="*fp32", INTS="*i64", LP="*fp32")
k = compile_sm90(_kept_kernel, ptrs, dict(HAS_FINAL=False, WIDTH=4, KP1=4), 1, 1)
assert k.asm["cubin"]
"""


@needs_ptxas()
def test_compiles_for_sm90() -> None:
    run_compiled(_COMPILE)
