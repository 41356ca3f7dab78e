"""NEXTN speculative decoding: the checkpoint's own multi-token-prediction layer drafts (tiny
DeepSeek-V3 with one MTP layer, fp32, CPU, engines stepped on this thread).

Greedy tokens, log-probs, top log-probs and routed experts equal the plain engine's (chunked
prefill, a shared prefix, a stop token, penalties, preemption); the drafter's proposals equal a
packed re-computation of the MTP chain from the target's hidden states (so the hidden-state and
MTP-cache bookkeeping is right, not only harmless); sampled tokens pass a two-sample chi-square
against the plain engine; the MTP weights load, update and are listed under the checkpoint's
names; NEXTN on a checkpoint without MTP layers, or with settings it cannot honour, is refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.models.attention import VarlenCausalAttention
from milepost.models.base import ForwardContext
from milepost.models.registry import load_model
from milepost.testing.hf_archs import make_tiny_hf_checkpoint
from milepost.testing.mtp_checkpoint import make_tiny_mtp_checkpoint
from milepost.engine.sampling import SamplingParams
from tests.e2e.test_speculative_engine_live import Run, greedy

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp")
    return {
        "mtp": make_tiny_mtp_checkpoint(root / "mtp", seed=0, vocab_size=64),
        "mtp16": make_tiny_mtp_checkpoint(root / "mtp16", seed=1, vocab_size=16, mtp_scale=0.3),
        "plain": make_tiny_hf_checkpoint(root / "plain", "deepseek_v3", seed=2, vocab_size=64),
    }


def make_engine(path: Path, **flags: object):
    settings = dict(device="cpu", dtype="float32", page_size=4, chunked_prefill_size=16,
                    max_total_tokens=1024) | flags
    return build_engine(ServerArgs(model_path=path, **settings).resolved())[0]


def prompts(n: int, seed: int, vocab: int = 64) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (6 + 7 * i,), generator=g).tolist() for i in range(n)]


def workload(r: Run, ps: list[list[int]], stop: int | None = None) -> None:
    for i, p in enumerate(ps):
        kw = {"return_logprob": True, "return_routed_experts": True}
        if i == 3:
            kw |= {"top_logprobs_num": 3}
        if i == 1 and stop is not None:
            kw["stop_ids"] = frozenset({stop})
        params = greedy(14, repetition_penalty=1.3) if i == 2 else greedy(12 + i)
        r.submit(f"r{i}", p, params, **kw)
    r.run(3)
    r.submit("shared", ps[3] + [7, 8, 9], greedy(10), return_logprob=True)  # reuses r3's prompt
    r.run()


def test_greedy_nextn_returns_the_plain_tokens_logprobs_and_experts(ckpts) -> None:
    ps = prompts(4, seed=1)  # the longest prompts (27 tokens) prefill in two chunks of 16
    plain = Run(make_engine(ckpts["mtp"]))
    workload(plain, ps)
    stop = plain.tokens("r1")[5]
    plain = Run(make_engine(ckpts["mtp"]))
    workload(plain, ps, stop)
    spec = Run(make_engine(ckpts["mtp"], speculative_algorithm="NEXTN", speculative_num_steps=3,
                           speculative_eagle_topk=1))
    assert spec.engine.speculator.k == 3
    workload(spec, ps, stop)
    for rid in plain.out:
        assert spec.tokens(rid) == plain.tokens(rid), rid
        assert spec.logprobs(rid) == pytest.approx(plain.logprobs(rid), abs=1e-4), rid
        assert spec.out[rid][-1].finish_reason == plain.out[rid][-1].finish_reason, rid
        assert spec.out[rid][-1].routed_experts == plain.out[rid][-1].routed_experts, rid
    a = [x for o in plain.out["r3"] for x in o.new_top_logprobs]
    b = [x for o in spec.out["r3"] for x in o.new_top_logprobs]
    assert len(a) == len(b) == 15 and torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)
    assert spec.out["shared"][-1].cached_tokens > 0
    s = spec.engine.speculator.stats
    assert s.proposed > 30 and s.verify_rows > 10
    eng = spec.engine
    assert eng.pool.num_used == (eng.cache.num_cached_blocks if eng.cache else 0), "blocks leaked"


def test_preemption_under_nextn_keeps_greedy_outputs(ckpts) -> None:
    ps = prompts(4, seed=2)
    runs = {}
    for algo in (None, "NEXTN"):
        flags = {"speculative_algorithm": algo} if algo else {}
        r = Run(make_engine(ckpts["mtp"], max_total_tokens=64, **flags))
        for i, p in enumerate(ps):
            r.submit(f"r{i}", p, greedy(14), return_logprob=True)
        r.run()
        runs[algo] = r
    assert runs["NEXTN"].engine.scheduler.num_preemptions > 0, "the pool should force preemption"
    for rid in runs[None].out:
        assert runs["NEXTN"].tokens(rid) == runs[None].tokens(rid), rid


def reference_chain(model, seq: list[int], k: int) -> list[torch.Tensor]:
    """The MTP chain recomputed in one packed pass per step: the target's states of seq[:-1],
    each paired with the next token, then the MTP's own output fed back with each proposal."""
    ids = torch.tensor(seq)
    n = len(seq) - 1
    ctx = ForwardContext(attention=VarlenCausalAttention(torch.tensor([0, n])))
    hidden = model.forward(ids[:n], torch.arange(n), ctx)
    toks, states, out = ids[1:], hidden, []
    for _ in range(k):
        m = toks.shape[0]
        ctx = ForwardContext(attention=VarlenCausalAttention(torch.tensor([0, m])))
        h = model.mtp_forward(toks, states, torch.arange(m), ctx)
        logits = model.compute_logits(h[-1:])[0]
        out.append(logits)
        toks = torch.cat([toks, logits.argmax().view(1)])
        states = torch.cat([states, h[-1:]])
    return out


def test_proposals_equal_the_packed_mtp_chain(ckpts) -> None:
    """Every greedy proposal equals the argmax of the MTP chain recomputed from scratch, across
    chunked prefill, several verify steps and rejected proposals (where the top-2 margin is clear)."""
    eng = make_engine(ckpts["mtp"], speculative_algorithm="NEXTN", disable_radix_cache=True)
    drafter = eng.speculator.drafter
    seen: list[tuple[list[int], list[int]]] = []
    propose = drafter.propose

    def recording(reqs, ks):
        out = propose(reqs, ks)
        seen.extend((list(r.all_ids), t) for r, (t, _) in zip(reqs, out))
        return out

    drafter.propose = recording
    r = Run(eng)
    for i, p in enumerate(prompts(3, seed=3)):
        r.submit(f"r{i}", p, greedy(12))
    r.run()
    model = load_model(ckpts["mtp"], torch.float32, "cpu")
    checked = 0
    with torch.no_grad():
        for seq, tokens in seen:
            assert tokens, "a decoding request always gets proposals here"
            for tok, logits in zip(tokens, reference_chain(model, seq, len(tokens))):
                top2 = logits.topk(2).values
                if top2[0] - top2[1] < 1e-3:
                    break  # a near tie: the engine may take either, and the chain then differs
                assert tok == int(logits.argmax()), (seq, tokens)
                checked += 1
    assert checked > 50


def chi_square_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """p-value of the two-sample chi-square (homogeneity) test of two count vectors."""
    keep = (a + b) > 0
    table = torch.stack([a[keep], b[keep]])
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    chi2 = ((table - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), chi2.double() / 2))


def test_sampled_tokens_follow_the_plain_distribution(ckpts) -> None:
    """Two-sample chi-square on output tokens 1-3 of 400 seeded samples, 16-token vocabulary,
    temperature 0.8: the MTP's proposals are accepted in part, rejections draw the residual."""
    prompt = [3, 4, 5, 6, 7, 8, 3, 4]
    counts = {}
    for spec in (False, True):
        flags = {"speculative_algorithm": "NEXTN", "speculative_num_draft_tokens": 3} if spec else {}
        r = Run(make_engine(ckpts["mtp16"], max_running_requests=200, max_total_tokens=8192, **flags))
        for i in range(400):
            seed = 10_000 + i if spec else i  # independent samples on both sides
            r.submit(f"s{i}", prompt, SamplingParams(max_new_tokens=4, temperature=0.8,
                                                     ignore_eos=True, sampling_seed=seed))
        r.run()
        toks = torch.tensor([r.tokens(f"s{i}") for i in range(400)])
        counts[spec] = [torch.bincount(toks[:, j], minlength=16).double() for j in (1, 2, 3)]
        if spec:
            s = r.engine.speculator.stats
            assert s.accepted > 20 and s.proposed - s.accepted > 50, s
    for a, b in zip(counts[False], counts[True]):
        assert chi_square_p(a, b) > 1e-4, (a, b)


def test_mtp_weights_load_update_and_are_listed_under_checkpoint_names(ckpts) -> None:
    from milepost.engine.weight_update import WeightLoader

    eng = make_engine(ckpts["mtp"], speculative_algorithm="NEXTN")
    model = eng.runner.model
    names = model.hf_weight_names()
    for n in ("model.layers.3.enorm.weight", "model.layers.3.eh_proj.weight",
              "model.layers.3.shared_head.norm.weight", "model.layers.3.self_attn.kv_b_proj.weight",
              "model.layers.3.mlp.experts.5.up_proj.weight", "model.layers.3.mlp.shared_experts.down_proj.weight"):
        assert n in names, n
    # DeepSeek's copies of the shared embedding and head are read, never held twice
    assert "model.layers.3.embed_tokens.weight" not in names
    assert "model.layers.3.shared_head.head.weight" not in names
    loader = WeightLoader(model)
    new = torch.full_like(model.weight_view("model.layers.3.eh_proj.weight"), 0.01)
    assert loader.from_named([("model.layers.3.eh_proj.weight", new)]) == 1
    assert torch.equal(model.mtp[0].eh_proj.weight, new)
    expert = torch.full_like(model.weight_view("model.layers.3.mlp.experts.5.up_proj.weight"), 0.5)
    loader.from_named([("model.layers.3.mlp.experts.5.up_proj.weight", expert)])
    inter = model.hf_config.moe_intermediate_size
    assert torch.equal(model.mtp[0].mlp.experts.w13[5, inter:], expert)
    assert loader.from_disk(str(ckpts["mtp"])) > 0  # the checkpoint as shipped: nothing missing
    assert not torch.equal(model.mtp[0].eh_proj.weight, new)
    # The trainer's export direction: every MTP parameter maps back to checkpoint names
    exported = {n for p, t in model.named_parameters() for n, _ in model.hf_tensors(p, t)}
    assert {n for n in names if n.startswith("model.layers.3.")} <= exported


def test_nextn_refusals_name_the_setting_and_the_fix(ckpts) -> None:
    with pytest.raises(ValueError, match="NEXTN.*no multi-token-prediction weights.*model.layers.3"):
        ServerArgs(model_path=ckpts["plain"], speculative_algorithm="NEXTN")
    with pytest.raises(ValueError, match="eagle-topk 2.*only 1"):
        ServerArgs(model_path=ckpts["mtp"], speculative_algorithm="EAGLE", speculative_eagle_topk=2)
    with pytest.raises(ValueError, match="num-steps 3.*num-draft-tokens is 5"):
        ServerArgs(model_path=ckpts["mtp"], speculative_algorithm="NEXTN", speculative_num_steps=3,
                   speculative_num_draft_tokens=5)
    with pytest.raises(ValueError, match="need --speculative-algorithm"):
        ServerArgs(model_path=ckpts["mtp"], speculative_num_steps=3)
    with pytest.raises(ValueError, match="separate EAGLE head"):
        ServerArgs(model_path=ckpts["mtp"], speculative_algorithm="EAGLE",
                   speculative_draft_model_path=ckpts["plain"])
    with pytest.raises(ValueError, match="model-impl transformers has none"):
        ServerArgs(model_path=ckpts["mtp"], speculative_algorithm="NEXTN", model_impl="transformers")
    # EAGLE is SGLang's name for the same thing: accepted, num_steps sets the count
    args = ServerArgs(model_path=ckpts["mtp"], speculative_algorithm="EAGLE", speculative_num_steps=2)
    assert args.verified_tokens() == 3


def test_nextn_refused_for_an_architecture_without_mtp(tmp_path: Path) -> None:
    from milepost.testing.checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "q", "qwen3", seed=0, with_tokenizer=False)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM.*no native MTP support.*NGRAM"):
        ServerArgs(model_path=path, speculative_algorithm="NEXTN")


def test_bench_reports_nextn_acceptance_in_the_same_run(ckpts) -> None:
    from milepost.bench.args import BenchArgs
    from milepost.bench.engine import run_bench

    result = run_bench(BenchArgs(model=ckpts["mtp"], speculative="nextn", scenarios="fixed",
                                 requests=4, prompt_len=12, output_len=16, temperature=0.0,
                                 hf=False, max_total_tokens=2048))
    spec = result["scenarios"][0]["speculative"]
    assert spec["algorithm"] == "nextn" and spec["proposed"] > 0
    assert 1.0 <= spec["accept_length"] <= 4.0
    with pytest.raises(ValueError, match="nextn.*--model"):
        BenchArgs(shape="qwen3-0.6b", speculative="nextn")


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_modes_keep_greedy_outputs(ckpts, mode) -> None:
    ps = prompts(3, seed=5)
    want = Run(make_engine(ckpts["mtp"]))
    for i, p in enumerate(ps):
        want.submit(f"r{i}", p, greedy(16))
    want.run()
    r = Run(make_engine(ckpts["mtp"], speculative_algorithm="NEXTN"))
    for i, p in enumerate(ps):
        r.submit(f"r{i}", p, greedy(16))
    r.run(4)
    r.engine.pause(mode)
    r.run(2)
    r.engine.resume()
    r.run()
    for rid in want.out:
        assert r.tokens(rid) == want.tokens(rid), (mode, rid)


def test_memory_release_covers_the_mtp_cache(ckpts) -> None:
    """Releasing kv_cache frees the MTP layer's pools too (they alias the runner's shadow pools);
    after the resume NEXTN still returns the plain engine's greedy tokens."""
    from milepost.engine.memory import MemoryOccupation

    eng = make_engine(ckpts["mtp"], speculative_algorithm="NEXTN")
    mtp = eng.speculator.drafter
    mem = MemoryOccupation(eng)
    freed = mem.release(["kv_cache", "weights"])
    assert mtp.kv.k[0].untyped_storage().nbytes() == 0 and freed >= mtp.kv.nbytes()
    mem.resume(["kv_cache", "weights"])
    assert eng.runner.shadow_pools[0].data_ptr() == mtp.kv.k[0].data_ptr()
    r, want = Run(eng), Run(make_engine(ckpts["mtp"]))
    for run in (r, want):
        run.submit("a", prompts(1, seed=6)[0], greedy(12))
        run.run()
    assert r.tokens("a") == want.tokens("a") and eng.speculator.stats.proposed > 0
