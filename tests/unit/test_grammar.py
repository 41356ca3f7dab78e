"""Structured output (grammar.py): llguidance's masks on the tiny tokenizer, applied by the sampler.

Masks are checked token by token against what the grammar allows; the sampler's masked rows must
only produce allowed tokens while unconstrained rows of the same batch are untouched, and the
reported log-probs are those of the masked distribution (the one sampled).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from milepost.engine.grammar import (
    GrammarCompiler,
    GrammarError,
    apply_masks,
    fill_masks,
    response_format_params,
)
from milepost.engine.sampling import SamplingParams, sample
from milepost.testing.tokenizer import build_tiny_tokenizer

pytest.importorskip("llguidance")
torch.set_num_threads(1)
V = 520  # wider than the tokenizer (512): padded ids are never allowed
EOS = 2


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(512)


@pytest.fixture(scope="module")
def compiler(tok) -> GrammarCompiler:
    c = GrammarCompiler(tok, V, [EOS])
    yield c
    c.close()


def allowed(mask_row: torch.Tensor) -> set[int]:
    return {t for t in range(V) if (int(mask_row[t // 32]) >> (t % 32)) & 1}


def test_regex_mask_allows_exactly_the_tokens_that_keep_a_match_possible(tok, compiler) -> None:
    pattern = r"[0-9]{2}-(ab|cd)"
    g = compiler.compile_now("regex", pattern)[0]
    prefix = ""
    for step in range(8):
        ok = allowed(fill_masks([g], [[]], V)[0])
        assert ok and max(ok) < len(tok)
        for t in range(len(tok)):  # every token's text vs the regex, by Python's re
            text = prefix + tok.decode([t])
            could = t != EOS and any(re.fullmatch(pattern, text + tail) for tail in _tails(text))
            if t == EOS:
                could = re.fullmatch(pattern, prefix) is not None
            assert (t in ok) == could, (prefix, t, tok.decode([t]))
        pick = min(ok)
        if pick == EOS:
            assert g.accept(pick) == "end"
            assert re.fullmatch(pattern, prefix)
            return
        assert g.accept(pick) is None
        prefix += tok.decode([pick])
    pytest.fail(f"the grammar never ended: {prefix!r}")


def _tails(text: str) -> list[str]:
    """Completions that matter for r'[0-9]{2}-(ab|cd)': enough to decide any prefix."""
    return ["", "b", "d", "ab", "cd", "-ab", "0-ab", "00-ab"]


def test_json_schema_walk_ends_in_a_valid_document(tok, compiler) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    g = compiler.compile_now("json_schema", json.dumps(schema))[0]
    gen = torch.Generator().manual_seed(0)
    out: list[int] = []
    for _ in range(60):
        ok = sorted(allowed(fill_masks([g], [[]], V)[0]))
        t = ok[int(torch.randint(len(ok), (1,), generator=gen))]
        if g.accept(t) == "end":
            break
        out.append(t)
    doc = json.loads(tok.decode(out))
    assert set(doc) == {"n", "ok"} and isinstance(doc["n"], int) and isinstance(doc["ok"], bool)


def test_ebnf_and_copies_advance_independently(tok, compiler) -> None:
    a, b = compiler.compile_now("ebnf", 'root ::= "yes" | "no"', copies=2)
    a.accept(tok.encode("yes")[0])
    assert allowed(fill_masks([b], [[]], V)[0]) != allowed(fill_masks([a], [[]], V)[0])


def test_bans_are_cleared_in_the_mask_unless_the_row_would_be_empty(tok, compiler) -> None:
    g = compiler.compile_now("regex", "a")[0]
    for t in tok.encode("a"):
        g.accept(t)
    assert allowed(fill_masks([g], [[]], V)[0]) == {EOS}
    # min_new_tokens bans EOS, but it is the only token left: the grammar's end wins
    assert allowed(fill_masks([g], [[EOS]], V)[0]) == {EOS}
    h = compiler.compile_now("regex", "[ab]")[0]
    banned = tok.encode("a")
    assert allowed(fill_masks([h], [banned], V)[0]) == allowed(fill_masks([h], [[]], V)[0]) - set(banned)


@pytest.mark.parametrize(("field", "text", "words"), [
    ("json_schema", "{not json", ["sampling_params.json_schema", "JSON"]),
    ("json_schema", '{"type": "nonsense"}', ["sampling_params.json_schema", "nonsense"]),
    ("regex", "a(b", ["sampling_params.regex", "unclosed group"]),
    ("ebnf", "root ::= (", ["sampling_params.ebnf"]),
])
def test_a_grammar_that_does_not_compile_names_its_field(compiler, field, text, words) -> None:
    with pytest.raises(GrammarError) as e:
        compiler.compile_now(field, text)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_no_fast_tokenizer_is_a_clear_error() -> None:
    with pytest.raises(GrammarError, match="tokenizer"):
        GrammarCompiler(None, V, [EOS]).compile_now("regex", "a")


def test_sampler_masks_only_the_constrained_rows_and_reports_masked_logprobs(compiler) -> None:
    g = compiler.compile_now("regex", "[0-9]+")[0]
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1)) * 4
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7),
              SamplingParams(temperature=0.0)]
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    masks = fill_masks([g], [[]], V)
    ok = sorted(allowed(masks[0]))
    free = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(3)], [[]] * 3)
    got = sample(logits, params, gens, [[]] * 3, masks=([1], masks))
    assert int(got.tokens[1]) in ok
    # rows 0 and 2 saw the same logits and draws: the same tokens and log-probs as without a mask
    assert got.tokens[[0, 2]].tolist() == free.tokens[[0, 2]].tolist()
    torch.testing.assert_close(got.logprobs[[0, 2]], free.logprobs[[0, 2]])
    masked = torch.full((V,), float("-inf"))
    masked[ok] = logits[1, ok] / 0.7
    want = torch.log_softmax(masked, dim=0)[got.tokens[1]]
    torch.testing.assert_close(got.logprobs[1], want)
    assert torch.isfinite(got.logprobs).all()


def test_apply_masks_on_all_rows_in_place() -> None:
    logits = torch.zeros(2, 40)
    masks = torch.zeros(2, 2, dtype=torch.int32)
    masks[0, 0] = 1 << 3
    masks[1, 1] = -(2**31)  # bit 31 of word 1: token 63, beyond the 40 columns
    masks[1, 0] = -(2**31)  # bit 31 (the sign bit) of word 0: token 31
    apply_masks(logits, [0, 1], masks)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [3]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [31]


def test_response_format_maps_as_sglang_maps_it() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert response_format_params(None) == {} and response_format_params({"type": "text"}) == {}
    assert response_format_params({"type": "json_object"}) == {"json_schema": '{"type": "object"}'}
    got = response_format_params({"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert json.loads(got["json_schema"]) == schema


@pytest.mark.parametrize(("fmt", "words"), [
    ({"type": "yaml"}, ["response_format.type", "yaml"]),
    ({"type": "json_schema"}, ["response_format.json_schema.schema"]),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}, ["schema"]),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "shema": 1}}, ["shema"]),
    ({"type": "json_object", "schema": {}}, ["response_format", "schema"]),
])
def test_a_malformed_response_format_names_the_part(fmt: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as e:
        response_format_params(fmt)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_masks_of_many_rows_equal_row_by_row(tok, compiler) -> None:
    gs = compiler.compile_now("json_schema", '{"type": "object"}', copies=3)
    gs += compiler.compile_now("regex", "[0-9]+x", copies=2)
    for g, text in zip(gs, ['{"a', "{", '{"b": 1', "12", ""]):
        for t in tok.encode(text):
            assert g.accept(t) is None
    together = fill_masks(gs, [[]] * len(gs), V)
    for i, g in enumerate(gs):
        assert torch.equal(together[i], fill_masks([g], [[]], V)[0])
    assert len({tuple(row.tolist()) for row in together}) == len(gs)
