"""The engine's tokens and log-probs against transformers, on tiny checkpoints (fp32, CPU).

The engine is driven in-process, step by step, so the batch shapes are exactly the hard ones:
mixed prompt lengths, requests admitted while others decode, prefill chunks of 8 tokens and KV
blocks of 4, a shared prefix served from the cache, and a pool so small that requests are
preempted and recomputed. Greedy output must equal `generate` token for token; reported
log-probs must equal a full-sequence recompute of log_softmax(logits / T).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from milepost.engine.engine import Engine
from milepost.engine.request import Request, RequestOutput
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.testing.checkpoints import make_tiny_checkpoint

ARCHS = ["llama", "qwen3", "qwen3_moe"]
VOCAB = 512
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parity")
    return {a: make_tiny_checkpoint(root / a, a, seed=i, with_tokenizer=False)
            for i, a in enumerate(ARCHS)}


@pytest.fixture(scope="module")
def hf_models(ckpts: dict[str, Path]) -> dict[str, torch.nn.Module]:
    models = {a: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
              for a, p in ckpts.items()}
    for m in models.values():
        # Like ignore_eos: never stop at EOS. (A generate() argument of None would fall back to
        # this default, and min_new_tokens would ban EOS from being picked at all.)
        m.generation_config.eos_token_id = None
    return models


def make_engine(path: Path, **flags: object) -> Engine:
    settings = dict(device="cpu", dtype="float32", page_size=4, chunked_prefill_size=8,
                    max_total_tokens=1024) | flags
    args = ServerArgs(model_path=path, **settings).resolved()
    return build_engine(args)[0]


class Driver:
    """Submits requests to a (not started) engine and steps it on this thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.requests: dict[str, Request] = {}
        self.batches: list[list[tuple[str, int, int]]] = []  # per forward: (rid, start, length)
        self.fed = 0  # forwards whose input tokens were still on the device (overlap schedule)
        self.fed_batches: list[list[tuple[str, int, int]]] = []  # those forwards' chunks
        forward = engine.runner.forward

        def recording_forward(chunks, feed=None):
            self.batches.append([(c.req.rid, c.start, c.length) for c in chunks])
            self.fed += feed is not None
            if feed is not None:
                self.fed_batches.append(self.batches[-1])
            return forward(chunks, feed)

        engine.runner.forward = recording_forward

    def submit(self, rid: str, prompt: list[int], params: SamplingParams,
               stop_ids: frozenset[int] = frozenset(), **kw: object) -> None:
        req = Request(rid=rid, prompt_ids=prompt, params=params, stop_ids=stop_ids,
                      on_output=lambda o: self.outputs.setdefault(rid, []).append(o), **kw)
        self.requests[rid] = req
        self.engine.submit(req)
        self.engine._drain_inbox(block=False)  # admit now, as the loop would before its next step

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.engine.step()

    def run(self) -> None:
        while self.engine.scheduler.has_work:
            self.engine.step()

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs.get(rid, []) for t in o.new_token_ids]

    def logprobs(self, rid: str) -> list[float]:
        return [lp for o in self.outputs[rid] for lp in o.new_logprobs]

    def final(self, rid: str) -> RequestOutput:
        last = self.outputs[rid][-1]
        assert last.finished, f"{rid} did not finish"
        return last


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


@torch.no_grad()
def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    cfg = GenerationConfig(max_new_tokens=n, do_sample=False, pad_token_id=0)
    out = hf.generate(torch.tensor([prompt]), generation_config=cfg)[0, len(prompt):].tolist()
    assert len(out) == n
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_generate_with_late_arrivals(arch, ckpts, hf_models) -> None:
    """Mixed lengths; a second wave arrives while the first decodes; chunks of 8, blocks of 4."""
    d = Driver(make_engine(ckpts[arch]))
    first = prompts([3, 17, 6, 1], seed=1)
    late = prompts([11, 23, 9, 2], seed=2)
    new_tokens = [12, 7, 10, 9, 8, 12, 5, 11]
    for i, p in enumerate(first):
        d.submit(f"a{i}", p, greedy(new_tokens[i]))
    d.step(5)
    decoding = [r for r in d.requests.values() if r.output_ids and not r.is_finished]
    assert len(decoding) >= 2, "the late wave must arrive while earlier requests decode"
    for i, p in enumerate(late):
        d.submit(f"b{i}", p, greedy(new_tokens[4 + i]))
    d.step(2)
    d.submit("c0", first[1][:9] + late[0], greedy(6))  # shares blocks with a0's cached prompt
    d.run()

    prompt_len = {rid: len(r.prompt_ids) for rid, r in d.requests.items()}
    mixed = [b for b in d.batches
             if any(start >= prompt_len[rid] for rid, start, _ in b)  # a decode
             and any(start + n < prompt_len[rid] for rid, start, n in b)]  # a partial prefill
    assert mixed, "some step should decode while another prompt is still mid-prefill"
    for rid, req in d.requests.items():
        want = hf_greedy(hf_models[arch], req.prompt_ids, req.params.max_new_tokens)
        assert d.tokens(rid) == want, f"{arch} {rid} (prompt {len(req.prompt_ids)} tokens)"
        assert d.final(rid).finish_reason == {"type": "length", "length": len(want)}
    # a1's first two full blocks are shared; its 9th token's KV is copied out of its third block
    assert d.final("c0").cached_tokens == 9, "c0 should reuse a1's first 9 tokens"


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_overlap_schedule_matches_generate(arch, ckpts, hf_models) -> None:
    """Decode steps launched before the previous step's tokens are read back (fed on the
    device): late arrivals, a stop token, requests ending at different lengths. Greedy tokens
    equal generate; a stopped request's extra token is dropped."""
    d = Driver(make_engine(ckpts[arch], overlap_schedule="on"))
    ps = prompts([7, 12, 5, 9, 3], seed=5)
    n_new = [9, 14, 6, 11, 8]
    want = [hf_greedy(hf_models[arch], p, n) for p, n in zip(ps, n_new)]
    stop = want[1][4]  # r1 stops at its 5th token (or earlier, where that token occurs first)
    for i in range(3):
        d.submit(f"r{i}", ps[i], greedy(n_new[i]), stop_ids=frozenset({stop}) if i == 1 else frozenset())
    d.step(4)
    for i in range(3, 5):
        d.submit(f"r{i}", ps[i], greedy(n_new[i]))
    d.run()
    assert d.fed > 0, "no step was launched ahead"
    for i in range(5):
        expect = want[i]
        if i == 1:
            expect = expect[: expect.index(stop) + 1]
        assert d.tokens(f"r{i}") == expect, f"{arch} r{i}"
    assert d.final("r1").finish_reason == {"type": "stop", "matched": stop}
    assert d.engine.pool.num_used == d.engine.cache.num_cached_blocks, "blocks leaked"


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_overlap_schedule_runs_mixed_steps_ahead(arch, ckpts, hf_models) -> None:
    """Steps with prompt chunks are launched ahead too: long prompts prefilled over several steps
    beside decodes, a queue past max_running admitted while a step is queued, submissions that
    do not apply the queued step, a stop token. Greedy tokens equal generate."""
    d = Driver(make_engine(ckpts[arch], overlap_schedule="on", max_running_requests=3))
    ps = prompts([5, 23, 9, 30, 4, 17], seed=11)
    n_new = [10, 6, 12, 5, 9, 7]
    want = [hf_greedy(hf_models[arch], p, n) for p, n in zip(ps, n_new)]
    stop = want[2][3]
    for i in range(4):
        d.submit(f"r{i}", ps[i], greedy(n_new[i]), stop_ids=frozenset({stop}) if i == 2 else frozenset())
    d.step(4)
    assert d.engine._launched is not None, "a step should be queued"
    d.submit("r4", ps[4], greedy(n_new[4]))
    assert d.engine._launched is not None, "a submission applied the queued step"
    d.step(1)
    d.submit("r5", ps[5], greedy(n_new[5]))
    d.run()
    prompt_len = {rid: len(r.prompt_ids) for rid, r in d.requests.items()}
    mixed_fed = [b for b in d.fed_batches if any(n > 1 for _, _, n in b)
                 and any(s >= prompt_len[rid] for rid, s, _ in b)]
    assert mixed_fed, "no step with a prompt chunk beside decodes was launched ahead"
    admitted = [b for b in d.fed_batches if any(s == 0 for _, s, _ in b)]
    assert admitted, "no request was admitted in a step launched ahead"
    for i in range(6):
        expect = want[i][: want[i].index(stop) + 1] if i == 2 and stop in want[i] else want[i]
        assert d.tokens(f"r{i}") == expect, f"{arch} r{i}"
    assert d.final("r2").finish_reason == {"type": "stop", "matched": stop}
    assert d.engine.pool.num_used == d.engine.cache.num_cached_blocks, "blocks leaked"


def test_overlap_schedule_applies_the_queued_step_before_an_abort(ckpts, hf_models) -> None:
    d = Driver(make_engine(ckpts["qwen3"], overlap_schedule="on"))
    ps = prompts([6, 9], seed=8)
    d.submit("r0", ps[0], greedy(12))
    d.submit("r1", ps[1], greedy(12))
    d.step(5)
    assert d.engine._launched is not None, "a decode step should be queued"
    d.engine.abort("r0")
    d.engine._drain_inbox(block=False)
    assert d.engine._launched is None
    got = d.tokens("r0")
    assert d.final("r0").finish_reason["type"] == "abort"
    assert -1 not in got and got == hf_greedy(hf_models["qwen3"], ps[0], 12)[: len(got)]
    assert len(got) == 5, "the queued step's token was applied before the abort"
    d.run()
    assert d.tokens("r1") == hf_greedy(hf_models["qwen3"], ps[1], 12)
    assert d.engine.pool.num_used == d.engine.cache.num_cached_blocks, "blocks leaked"


@pytest.mark.parametrize("arch", ARCHS)
def test_next_turn_reuses_a_partial_block_exactly(arch, ckpts, hf_models) -> None:
    """Turn 2 = turn 1's prompt + output + 3 user tokens. Its 17 computed tokens of KV are 4
    whole blocks of 4 and 1 entry of a fifth, which is copied into a fresh block: cached 17.
    Greedy tokens equal generate and an engine without the prefix cache."""
    p = prompts([11], seed=7)[0]
    got = {}
    for cache in (True, False):
        d = Driver(make_engine(ckpts[arch], disable_radix_cache=not cache))
        d.submit("t1", p, greedy(7))
        d.run()
        turn2 = p + d.tokens("t1") + [5, 6, 7]
        d.submit("t2", turn2, greedy(6))
        d.run()
        got[cache] = (d.tokens("t1"), d.tokens("t2"), d.final("t2").cached_tokens)
        if cache:  # the second turn computed only what the cache could not hold
            assert [(s, n) for rid, s, n in d.batches[-6] if rid == "t2"] == [(17, 4)]
    assert got[True][2] == 17 and got[False][2] == 0
    assert got[True][:2] == got[False][:2]
    assert got[True][1] == hf_greedy(hf_models[arch], p + got[True][0] + [5, 6, 7], 6)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_greedy_matches_generate_under_preemption(arch, overlap, ckpts, hf_models) -> None:
    """A 12-block pool cannot hold all requests: preempted ones are recomputed, output unchanged."""
    d = Driver(make_engine(ckpts[arch], max_total_tokens=48, overlap_schedule=overlap))
    ps = prompts([10, 7, 13, 5, 9], seed=3)
    for i, p in enumerate(ps):
        d.submit(f"r{i}", p, greedy(14))
    d.run()
    assert d.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    assert (d.fed > 0) == (overlap == "on")
    for i, p in enumerate(ps):
        assert d.tokens(f"r{i}") == hf_greedy(hf_models[arch], p, 14), f"{arch} r{i}"
    assert d.engine.pool.num_used == d.engine.cache.num_cached_blocks, "blocks leaked"


SAMPLED = {
    "t0.7_p0.9_k20": SamplingParams(temperature=0.7, top_p=0.9, top_k=20),
    "t1.0_p0.8_k50": SamplingParams(temperature=1.0, top_p=0.8, top_k=50),
    "t1.0_plain": SamplingParams(temperature=1.0),
    "t0.7_minp": SamplingParams(temperature=0.7, min_p=0.05, top_k=30),
    "greedy": SamplingParams(temperature=0.0),  # reports log_softmax(logits), i.e. T = 1
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_logprobs_equal_full_sequence_recompute(arch, overlap, ckpts, hf_models) -> None:
    d = Driver(make_engine(ckpts[arch], overlap_schedule=overlap))
    ps = prompts([5, 14, 2, 9, 20], seed=4)
    for i, (name, params) in enumerate(SAMPLED.items()):
        params = params.model_copy(update={"max_new_tokens": 16, "ignore_eos": True,
                                           "sampling_seed": 100 + i})
        d.submit(name, ps[i], params, return_logprob=True, top_logprobs_num=3 if i == 0 else 0)
        d.step(2)  # staggered arrivals: later requests join a batch that is already decoding
    d.run()

    hf = hf_models[arch]
    for name, req in d.requests.items():
        out = d.tokens(name)
        assert len(out) == 16
        seq = torch.tensor([req.prompt_ids + out])
        with torch.no_grad():
            logits = hf(seq).logits[0, len(req.prompt_ids) - 1 : -1].float()  # [16, V]
        temp = req.params.temperature if not req.params.greedy else 1.0
        ref = torch.log_softmax(logits / temp, dim=-1)
        want = ref.gather(1, torch.tensor(out)[:, None]).squeeze(1)
        got = torch.tensor(d.logprobs(name))
        assert (got - want).abs().max().item() < LOGPROB_ATOL, f"{arch} {name}"
        k = req.params.top_k
        if k > 0:  # every sampled token must come from the k most likely
            kth = logits.topk(k, dim=-1).values[:, -1]
            picked = logits.gather(1, torch.tensor(out)[:, None]).squeeze(1)
            assert bool((picked >= kth - 1e-4).all()), f"{arch} {name}: a token outside the top-k"
        if req.params.greedy:
            assert out == logits.argmax(-1).tolist()

    first = next(iter(SAMPLED))
    req = d.requests[first]
    tops = [row for o in d.outputs[first] for row in o.new_top_logprobs]
    seq = torch.tensor([req.prompt_ids + d.tokens(first)])
    with torch.no_grad():
        logits = hf(seq).logits[0, len(req.prompt_ids) - 1 : -1].float()
    ref_lp, ref_ids = torch.log_softmax(logits / 0.7, dim=-1).topk(3, dim=-1)
    assert [[t for _, t in row] for row in tops] == ref_ids.tolist()
    got_lp = torch.tensor([[lp for lp, _ in row] for row in tops])
    assert (got_lp - ref_lp).abs().max().item() < LOGPROB_ATOL


def test_sampling_is_reproducible_with_seed_and_differs_across_seeds(ckpts) -> None:
    """A seeded request draws the same tokens whatever else shares its batch, and whether or
    not decode steps are launched ahead (the crowded engine runs the overlap schedule)."""
    params = SamplingParams(max_new_tokens=20, temperature=1.0, ignore_eos=True, sampling_seed=7)
    prompt = prompts([6], seed=5)[0]
    alone = Driver(make_engine(ckpts["qwen3"]))
    alone.submit("x", prompt, params)
    alone.run()
    crowded = Driver(make_engine(ckpts["qwen3"], overlap_schedule="on"))
    for i, p in enumerate(prompts([4, 9, 13], seed=6)):
        crowded.submit(f"other{i}", p, params.model_copy(update={"sampling_seed": None}))
    crowded.step(3)
    crowded.submit("x", prompt, params)
    crowded.submit("y", prompt, params.model_copy(update={"sampling_seed": 8}))
    crowded.run()
    assert crowded.fed > 0
    assert crowded.tokens("x") == alone.tokens("x")
    assert crowded.tokens("y") != alone.tokens("x")
