"""Grammar rows inside the engine's hard schedules, driven in-process step by step (tiny Qwen3, CPU).

The overlap schedule (decode launched before the last token is read back), pause with retract
(KV dropped and recomputed), preemption in a pool too small for every request, and abort: free
rows must produce exactly what they produce without grammar rows beside them, grammar rows must
match their grammar, and nothing may leak.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from milepost.engine.engine import Engine
from milepost.engine.grammar import GrammarCompiler
from milepost.engine.request import Request, RequestOutput
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.testing.checkpoints import make_tiny_checkpoint

pytest.importorskip("llguidance")
REGEX = r"[a-z]{3,12}-[0-9]{2,9}"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("structured"), "qwen3", seed=4)


def engine_of(ckpt: Path, **flags: object) -> tuple[Engine, GrammarCompiler]:
    settings = {"device": "cpu", "dtype": "float32", "page_size": 4, "chunked_prefill_size": 8,
                "max_total_tokens": 1024} | flags
    engine, info, tok = build_engine(ServerArgs(model_path=ckpt, **settings).resolved())
    return engine, GrammarCompiler(tok, info.vocab_size, info.eos_token_ids)


EOS = 2  # the tiny tokenizer's <|im_end|>


class Driver:
    """Submits to a (not started) engine and steps it on this thread."""

    def __init__(self, engine: Engine, compiler: GrammarCompiler) -> None:
        self.engine, self.compiler = engine, compiler
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.fed = 0
        forward = engine.runner.forward

        def counting(chunks, feed=None):
            self.fed += feed is not None
            return forward(chunks, feed)

        engine.runner.forward = counting

    def submit(self, rid: str, prompt: list[int], n: int, grammar: str | None = None) -> None:
        params = SamplingParams(max_new_tokens=n, temperature=0.0 if grammar is None else 1.0,
                                sampling_seed=None if grammar is None else 11,
                                ignore_eos=grammar is None)
        g = self.compiler.compile_now("regex", grammar)[0] if grammar else None
        # Free rows run to their length (as the benchmarks do); grammar rows stop at EOS.
        req = Request(rid=rid, prompt_ids=prompt, params=params, grammar=g,
                      stop_ids=frozenset() if grammar is None else frozenset({EOS}),
                      on_output=lambda o: self.outputs.setdefault(rid, []).append(o))
        req.generator = torch.Generator().manual_seed(params.sampling_seed or 0)
        self.engine._add(req)  # the engine is not started: admit on this thread

    def run(self) -> None:
        while self.engine.scheduler.has_work:
            self.engine.step()
        self.engine._flush()

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs[rid] for t in o.new_token_ids]

    def final(self, rid: str) -> RequestOutput:
        assert self.outputs[rid][-1].finished, rid
        return self.outputs[rid][-1]


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 500, (n,), generator=g).tolist() for n in lengths]


def free_alone(ckpt: Path, ps: list[list[int]], n: int, **flags: object) -> list[list[int]]:
    d = Driver(*engine_of(ckpt, **flags))
    for i, p in enumerate(ps):
        d.submit(f"f{i}", p, n)
    d.run()
    return [d.tokens(f"f{i}") for i in range(len(ps))]


@pytest.mark.parametrize("flags", [{"overlap_schedule": "on"}, {"max_total_tokens": 64}],
                         ids=["overlap", "preempting-pool"])
def test_mixed_batches_under_overlap_and_preemption(ckpt: Path, flags: dict) -> None:
    ps = prompts([9, 5, 13, 7], seed=3)
    want = free_alone(ckpt, ps[:2], 30, **flags)
    engine, compiler = engine_of(ckpt, **flags)
    d = Driver(engine, compiler)
    tok = compiler.tokenizer
    d.submit("f0", ps[0], 30)  # outlives the grammar rows: decodes alone at the end
    d.submit("g0", ps[2], 12, REGEX)
    for _ in range(4):
        engine.step()
    d.submit("f1", ps[1], 30)  # arrives while a grammar row decodes
    d.submit("g1", ps[3], 12, REGEX)
    d.run()
    assert [d.tokens("f0"), d.tokens("f1")] == want
    for rid in ("g0", "g1"):
        out = d.final(rid)
        text = tok.decode([t for t in d.tokens(rid) if t != EOS])
        if out.finish_reason["type"] == "stop":
            assert re.fullmatch(REGEX, text), text
        else:  # cut by max_new_tokens: still a prefix the grammar allows
            assert out.finish_reason["type"] == "length"
            assert re.fullmatch(r"[a-z]{1,12}(-[0-9]{0,9})?", text), text
    if flags.get("overlap_schedule") == "on":
        assert d.fed > 0, "free rows decoding alone should still run ahead"
    else:
        assert engine.scheduler.num_preemptions > 0, "the small pool should preempt"
    assert engine.pool.num_used == (engine.cache.num_cached_blocks if engine.cache else 0)


def test_grammar_rows_run_ahead_under_the_overlap_schedule(ckpt: Path) -> None:
    """A grammar's mask for the next step follows the queued step's token once it is applied, so
    steps with grammar rows are launched ahead too: the seeded grammar rows draw the same tokens
    with the overlap schedule as without it (and end as the regex allows)."""
    ps = prompts([9, 5, 13], seed=4)
    got = {}
    for overlap in ("on", "off"):
        engine, compiler = engine_of(ckpt, overlap_schedule=overlap)
        d = Driver(engine, compiler)
        ahead = [0]  # forwards launched ahead with a grammar row in them
        forward = engine.runner.forward

        def counting(chunks, feed=None, forward=forward, ahead=ahead):  # noqa: ANN001, ANN202
            ahead[0] += feed is not None and any(c.req.grammar is not None for c in chunks)
            return forward(chunks, feed)

        engine.runner.forward = counting
        d.submit("g0", ps[0], 12, REGEX)
        d.submit("f0", ps[1], 20)
        d.submit("g1", ps[2], 12, REGEX)
        d.run()
        got[overlap] = ({rid: d.tokens(rid) for rid in ("g0", "f0", "g1")}, ahead[0])
    assert got["on"][0] == got["off"][0]
    assert got["on"][1] > 0 and got["off"][1] == 0
    tok = compiler.tokenizer
    for rid in ("g0", "g1"):
        text = tok.decode([t for t in got["on"][0][rid] if t != EOS])
        assert re.fullmatch(r"[a-z]{1,12}(-[0-9]{0,9})?", text), text


def test_retract_and_abort_of_grammar_rows(ckpt: Path) -> None:
    engine, compiler = engine_of(ckpt)
    d = Driver(engine, compiler)
    ps = prompts([6, 8], seed=9)
    d.submit("g0", ps[0], 40, r"[a-z]{30,40}")
    d.submit("g1", ps[1], 40, r"[a-z]{30,40}")
    for _ in range(8):
        engine.step()
    engine.pause("retract")  # KV dropped; the matchers keep their state
    engine.resume()
    for _ in range(3):
        engine.step()
    engine._abort("g1", "aborted by request")
    d.run()
    tok = compiler.tokenizer
    g0 = tok.decode([t for t in d.tokens("g0") if t != EOS])
    assert re.fullmatch(r"[a-z]{30,40}", g0), g0
    assert d.final("g1").finish_reason["type"] == "abort"
    assert re.fullmatch(r"[a-z]*", tok.decode(d.tokens("g1")))
    assert engine.pool.num_used == engine.cache.num_cached_blocks
