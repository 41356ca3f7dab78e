"""Speculative decoding in the real engine (tiny checkpoints, fp32, CPU), driven step by step.

Greedy tokens, log-probs and routed experts must equal the same engine without speculation, with
the hard cases in one run: prompts sharing a cached prefix, a KV pool so small that requests are
preempted, a stop token inside an accepted run, penalties (those requests decode without
proposals), pause with retract and in place. Sampled tokens: a two-sample chi-square between
speculative and plain engines on one prompt. STANDALONE runs a draft of the target's own
checkpoint (all proposals accepted under greedy) and a perturbed copy (accepted in part).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milepost.engine.engine import Engine
from milepost.engine.request import Request, RequestOutput
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.testing.checkpoints import make_tiny_checkpoint

VOCAB = 512


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    make_tiny_checkpoint(root / "qwen3", "qwen3", seed=0, with_tokenizer=False)
    return {
        "qwen3": root / "qwen3",
        "noisy": noisy_copy(root / "qwen3", root / "noisy"),
        "moe": make_tiny_checkpoint(root / "moe", "qwen3_moe", seed=1, with_tokenizer=False),
        "small_vocab": make_tiny_checkpoint(root / "v16", "qwen3", seed=2, vocab_size=16,
                                            with_tokenizer=False),
        "small_noisy": noisy_copy(root / "v16", root / "v16_noisy"),
        "other_vocab": make_tiny_checkpoint(root / "v300", "qwen3", seed=3, vocab_size=300,
                                            with_tokenizer=False),
    }


def noisy_copy(src: Path, dst: Path) -> Path:
    """The checkpoint with every weight perturbed: a draft that agrees with it only in part."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.std().clamp(min=1e-3))
    model.save_pretrained(dst, safe_serialization=True)
    return dst


def make_engine(path: Path, **flags: object) -> Engine:
    settings = dict(device="cpu", dtype="float32", page_size=4, chunked_prefill_size=16,
                    max_total_tokens=1024) | flags
    return build_engine(ServerArgs(model_path=path, **settings).resolved())[0]


class Run:
    """Requests on a (not started) engine, stepped on this thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.out: dict[str, list[RequestOutput]] = {}

    def submit(self, rid: str, prompt: list[int], params: SamplingParams, **kw: object) -> None:
        self.engine.submit(Request(rid=rid, prompt_ids=prompt, params=params,
                                   on_output=lambda o: self.out.setdefault(rid, []).append(o),
                                   stop_ids=kw.pop("stop_ids", frozenset()), **kw))
        self.engine._drain_inbox(block=False)

    def run(self, steps: int | None = None) -> None:
        n = 0
        while self.engine.scheduler.has_work and (steps is None or n < steps):
            self.engine.step()
            n += 1

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.out[rid] for t in o.new_token_ids]

    def logprobs(self, rid: str) -> list[float]:
        return [x for o in self.out[rid] for x in o.new_logprobs]


def looping_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase: n-gram lookup finds continuations in them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        phrase = torch.randint(3, VOCAB, (3 + i % 4,), generator=g).tolist()
        out.append(phrase * 3 + phrase[:2])
    return out


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def workload(r: Run, ps: list[list[int]], stop: int | None = None) -> None:
    for i, p in enumerate(ps):
        kw = {"return_logprob": True, "return_routed_experts": True}
        if i == 3:  # top log-probs and chosen ids' log-probs are read from the verify rows
            kw |= {"top_logprobs_num": 3, "token_ids_logprob": [5, 9]}
        if i == 1 and stop is not None:
            kw["stop_ids"] = frozenset({stop})
        params = greedy(24, repetition_penalty=1.3) if i == 2 else greedy(16 + i)
        r.submit(f"r{i}", p, params, **kw)
    r.run(3)
    r.submit("shared", ps[0] + [7, 8, 9], greedy(10), return_logprob=True)  # reuses r0's prompt
    r.run()


def test_ngram_rests_overlapped_while_it_proposes_nothing(ckpts) -> None:
    """The n-gram back-off (speculative.py): steps after one that proposed nothing run as plain
    overlapped decode steps, and the tokens and log-probs stay plain decoding's; without the
    overlap schedule it never rests."""
    ps = [list(range(20 + 30 * i, 40 + 30 * i)) for i in range(3)]  # no phrase repeats in them
    plain = Run(make_engine(ckpts["qwen3"]))
    spec = Run(make_engine(ckpts["qwen3"], speculative_algorithm="NGRAM", overlap_schedule="on"))
    still = Run(make_engine(ckpts["qwen3"], speculative_algorithm="NGRAM", overlap_schedule="off"))
    for r in (plain, spec, still):
        for i, p in enumerate(ps):
            r.submit(f"r{i}", p, greedy(24), return_logprob=True)
        r.run()
    for r in (spec, still):
        for rid in plain.out:
            assert r.tokens(rid) == plain.tokens(rid), rid
            assert r.logprobs(rid) == pytest.approx(plain.logprobs(rid), abs=1e-4), rid
    assert spec.engine.speculator.can_rest and spec.engine.speculator.stats.rested_steps > 0
    assert not still.engine.speculator.can_rest and still.engine.speculator.stats.rested_steps == 0
    eng = spec.engine
    assert eng.pool.num_used == (eng.cache.num_cached_blocks if eng.cache else 0), "blocks leaked"


@pytest.mark.parametrize("measured", [True, False])
def test_ngram_measured_rest_keeps_the_plain_tokens(measured, ckpts) -> None:
    """With the overlap schedule NGRAM times its speculative steps against the plain steps it
    rests (speculative_pace.py): the first verify step is followed by a probe of plain steps,
    both rates are measured, and the tokens stay plain decoding's whichever steps it takes."""
    ps = looping_prompts(4, seed=3)
    plain = Run(make_engine(ckpts["qwen3"]))
    spec = Run(make_engine(ckpts["qwen3"], speculative_algorithm="NGRAM", overlap_schedule="on",
                           speculative_ngram_measured_rest=measured))
    for r in (plain, spec):
        for i, p in enumerate(ps):
            r.submit(f"r{i}", p, greedy(40), return_logprob=True)
        r.run()
    for rid in plain.out:
        assert spec.tokens(rid) == plain.tokens(rid), rid
        assert spec.logprobs(rid) == pytest.approx(plain.logprobs(rid), abs=1e-4), rid
    pace, stats = spec.engine.speculator.pace, spec.engine.speculator.stats
    assert stats.verify_rows > 0 and pace.spec_rate is not None
    if measured:  # the probe after the first verify step measured plain decoding
        assert pace.plain_rate is not None and stats.rested_steps >= pace.PROBE
    else:
        assert pace.slower_rests == 0


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE"])
def test_greedy_speculation_returns_the_plain_tokens_and_logprobs(algo, ckpts) -> None:
    ps = looping_prompts(5, seed=1)
    plain = Run(make_engine(ckpts["qwen3"]))
    workload(plain, ps)
    stop = plain.tokens("r1")[6]
    plain = Run(make_engine(ckpts["qwen3"]))
    workload(plain, ps, stop)
    flags = {"speculative_algorithm": algo}
    if algo == "STANDALONE":
        flags["speculative_draft_model_path"] = ckpts["qwen3"]
    spec = Run(make_engine(ckpts["qwen3"], speculative_num_draft_tokens=4, **flags))
    workload(spec, ps, stop)
    for rid in plain.out:
        assert spec.tokens(rid) == plain.tokens(rid), rid
        assert spec.logprobs(rid) == pytest.approx(plain.logprobs(rid), abs=1e-4), rid
        assert spec.out[rid][-1].finish_reason == plain.out[rid][-1].finish_reason, rid
    for field in ("new_top_logprobs", "new_ids_logprobs"):
        a = [x for o in plain.out["r3"] for x in getattr(o, field)]
        b = [x for o in spec.out["r3"] for x in getattr(o, field)]
        assert len(a) == len(b) == 19 and torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)
    assert spec.out["shared"][-1].cached_tokens > 0
    stats = spec.engine.speculator.stats
    assert stats.accepted > 0 and stats.accept_length > 1.0
    if algo == "STANDALONE":  # the draft is the target itself: every proposal passes
        assert stats.accepted == stats.proposed
    eng = spec.engine
    assert eng.pool.num_used == (eng.cache.num_cached_blocks if eng.cache else 0), "blocks leaked"


def test_routed_experts_and_preemption_under_speculation(ckpts) -> None:
    """MoE target, a pool of 40 tokens: requests are preempted and recomputed mid-speculation."""
    ps = looping_prompts(4, seed=2)
    runs = {}
    for algo in (None, "NGRAM"):
        flags = {"speculative_algorithm": algo} if algo else {}
        r = Run(make_engine(ckpts["moe"], max_total_tokens=48, **flags))
        for i, p in enumerate(ps):
            r.submit(f"r{i}", p, greedy(14), return_logprob=True, return_routed_experts=True)
        r.run()
        runs[algo] = r
    assert runs["NGRAM"].engine.scheduler.num_preemptions > 0, "the pool should force preemption"
    assert runs["NGRAM"].engine.speculator.stats.accepted > 0
    for rid in runs[None].out:
        a, b = runs[None], runs["NGRAM"]
        assert b.tokens(rid) == a.tokens(rid), rid
        assert b.out[rid][-1].routed_experts == a.out[rid][-1].routed_experts, rid


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_modes_keep_greedy_outputs(mode, ckpts) -> None:
    ps = looping_prompts(3, seed=3)
    want = Run(make_engine(ckpts["qwen3"]))
    for i, p in enumerate(ps):
        want.submit(f"r{i}", p, greedy(20))
    want.run()
    r = Run(make_engine(ckpts["qwen3"], speculative_algorithm="STANDALONE",
                        speculative_draft_model_path=ckpts["noisy"]))
    for i, p in enumerate(ps):
        r.submit(f"r{i}", p, greedy(20))
    r.run(5)
    r.engine.pause(mode)
    r.run(2)  # a paused engine's loop would not step; stepping shows nothing breaks either way
    r.engine.resume()
    r.run()
    for rid in want.out:
        assert r.tokens(rid) == want.tokens(rid), (mode, rid)
    s = r.engine.speculator.stats
    assert 0 < s.accepted < s.proposed, "a draft of other weights should be accepted only in part"


@pytest.mark.parametrize("algo", ["NGRAM", "NGRAM-prompt", "STANDALONE"])
def test_sampled_tokens_follow_the_plain_distribution(algo, ckpts) -> None:
    """Two-sample chi-square (homogeneity) on output tokens 1-3 of 600 seeded samples of one
    prompt, plain engine vs speculative engine, 16-token vocabulary, temperature 0.7. The draft
    model is a perturbed copy: its proposals are accepted in part, rejections use the residual.
    NGRAM looks in the request's own text (a looping prompt); NGRAM-prompt in the 600 siblings'
    texts too (a prompt without repeats, so most proposals come from siblings)."""
    prompt = [3, 4, 5, 6] * 3 + [3, 4] if algo == "NGRAM" else [3, 9, 4, 12, 5, 7, 6, 14]
    counts = {}
    for spec in (False, True):
        flags = {}
        if spec:
            flags = {"speculative_algorithm": algo.split("-")[0], "speculative_num_draft_tokens": 3}
            if algo.startswith("NGRAM"):
                flags["speculative_ngram_min_match_window_size"] = 1
                flags["speculative_ngram_scope"] = "request" if algo == "NGRAM" else "prompt"
            else:
                flags["speculative_draft_model_path"] = ckpts["small_noisy"]
        r = Run(make_engine(ckpts["small_vocab"], max_running_requests=256, max_total_tokens=16384,
                            **flags))
        for i in range(600):
            seed = 10_000 + i if spec else i  # independent samples on both sides
            r.submit(f"s{i}", prompt, SamplingParams(max_new_tokens=4, temperature=0.7,
                                                     ignore_eos=True, sampling_seed=seed))
        r.run()
        toks = torch.tensor([r.tokens(f"s{i}") for i in range(600)])
        counts[spec] = [torch.bincount(toks[:, j], minlength=16).double() for j in (1, 2, 3)]
        if spec:
            s = r.engine.speculator.stats
            assert s.accepted > 20 and s.proposed - s.accepted > 100, s
    for a, b in zip(counts[False], counts[True]):
        keep = (a + b) > 0
        table = torch.stack([a[keep], b[keep]])
        expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
        chi2 = ((table - expected) ** 2 / expected).sum()
        df = int(keep.sum()) - 1
        p = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), chi2.double() / 2)
        assert p > 1e-4, (a, b)


def test_a_draft_of_another_vocabulary_is_refused_at_start(ckpts) -> None:
    with pytest.raises(ValueError, match="vocab_size 300.*target's vocabulary"):
        ServerArgs(model_path=ckpts["qwen3"], speculative_algorithm="STANDALONE",
                   speculative_draft_model_path=ckpts["other_vocab"])


def test_draft_weights_update_alongside_the_target(ckpts) -> None:
    """`draft/<name>` tensors land in the draft model, the target's names in the target; both are
    listed for the weight check; a disk update of the target alone stays complete."""
    from milepost.engine.weight_update import WeightLoader

    eng = make_engine(ckpts["qwen3"], speculative_algorithm="STANDALONE",
                      speculative_draft_model_path=ckpts["noisy"])
    target, draft = eng.runner.model, eng.speculator.drafter.model
    names = target.hf_weight_names()
    assert "draft/model.embed_tokens.weight" in names and "model.embed_tokens.weight" in names
    before = target.weight_view("model.embed_tokens.weight").clone()
    new = torch.full_like(draft.weight_view("model.norm.weight"), 0.5)
    loader = WeightLoader(target)
    assert loader.from_named([("draft/model.norm.weight", new)]) == 1
    assert torch.equal(draft.weight_view("model.norm.weight"), new)
    assert torch.equal(target.weight_view("model.embed_tokens.weight"), before)
    assert loader.from_disk(str(ckpts["qwen3"])) > 0  # the target's checkpoint: nothing missing
    with pytest.raises(Exception, match="draft/model.nope"):
        loader.from_named([("draft/model.nope", new)])


def test_bench_reports_acceptance_and_speedup_in_the_same_run(ckpts) -> None:
    from milepost.bench.args import BenchArgs
    from milepost.bench.engine import run_bench

    result = run_bench(BenchArgs(model=ckpts["qwen3"], speculative=f"draft:{ckpts['qwen3']}",
                                 scenarios="fixed", requests=4, prompt_len=16, output_len=24,
                                 temperature=0.0, hf=False, max_total_tokens=2048))
    row = result["scenarios"][0]
    spec = row["speculative"]
    # The draft is the target: every proposal is accepted, k + 1 = 4 tokens per verify step
    # (fewer only where a request's last tokens leave less room).
    assert spec["accepted"] == spec["proposed"] > 0
    assert 3.0 < spec["accept_length"] <= 4.0
    assert spec["speedup"] == pytest.approx(spec["tok_s"] / row["milepost_tok_s"])
    assert row["output_tokens"] == 4 * 24


def test_served_over_http_with_n_samples(qwen3_dir: Path, qwen3_server, start_server) -> None:
    """`milepost serve --speculative-algorithm NGRAM`: /generate with n = 3 greedy samples and
    log-probs answers what the shared plain server answers."""
    import httpx

    body = {"input_ids": [5, 6, 7, 8] * 4, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True, "n": 3}}
    srv = start_server(qwen3_dir, "--max-total-tokens", "4096", "--speculative-algorithm", "NGRAM",
                       "--speculative-num-draft-tokens", "5")
    answers = []
    for url in (qwen3_server.url, srv.url):
        r = httpx.post(f"{url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        answers.append(r.json())
    plain, spec = answers
    assert len(spec) == 3
    for a, b in zip(plain, spec):
        assert b["output_ids"] == a["output_ids"]
        la = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        lb = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
        assert lb == pytest.approx(la, abs=1e-4)


def test_memory_release_covers_the_draft_model(ckpts) -> None:
    """Releasing kv_cache and weights frees the draft's pools and weights too; after the resume
    the draft (weights from the host copy) still proposes what the target accepts."""
    from milepost.engine.memory import MemoryOccupation

    eng = make_engine(ckpts["qwen3"], speculative_algorithm="STANDALONE",
                      speculative_draft_model_path=ckpts["qwen3"])
    draft = eng.speculator.drafter
    mem = MemoryOccupation(eng)
    before = draft.model.weight_view("model.norm.weight").clone()
    freed = mem.release(["kv_cache", "weights"])
    assert draft.kv.k[0].untyped_storage().nbytes() == 0
    assert freed >= draft.kv.nbytes() + before.numel() * 4
    mem.resume(["kv_cache", "weights"])
    assert torch.equal(draft.model.weight_view("model.norm.weight"), before)
    r = Run(eng)
    r.submit("a", looping_prompts(1, seed=4)[0], greedy(12))
    r.run()
    assert len(r.tokens("a")) == 12 and eng.speculator.stats.accepted == eng.speculator.stats.proposed > 0
