"""--true-on-policy on CPU: the engine's log-probs equal the trainer's bit for bit (torch.equal).

For qwen3 and llama tiny checkpoints in fp32 and bf16, an in-process engine serves a mixed batch
(prefill chunks of 8 beside decodes, a prompt longer than a chunk, sampled and greedy rows) and
then a second batch that hits the prefix cache; the FSDP trainer (one gloo rank) scores the same
sequences and trains on them. Control: the same engine without the flag differs in bf16, so the
equality is the contract's doing. Refusals of runs without a profile are checked too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from milepost.engine.request import Request, RequestOutput
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.onpolicy.profiles import profile_refusals
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks

PROMPT_A = [5, 9, 33, 71, 12, 4, 90, 11, 3, 8, 15, 21, 40, 41]  # > one prefill chunk of 8
PROMPT_B = [7, 7, 21, 300, 5]
PROMPT_C = PROMPT_A[:10] + [66, 67]  # shares 10 tokens with A: a prefix-cache hit in round 2


def _engine(path: str, dtype: str, on: bool):
    args = ServerArgs(model_path=Path(path), device="cpu", dtype=dtype, page_size=4, chunked_prefill_size=8,
                      max_total_tokens=1024, true_on_policy=on)
    return build_engine(args.resolved())[0]


def _generate(engine, jobs: list[tuple[list[int], float, int]]) -> list[tuple[list[int], list[float], int]]:
    """Submit jobs (prompt, temperature, seed) together, step to the end: (tokens, logprobs, cached)."""
    outs: dict[int, list[RequestOutput]] = {}
    for i, (prompt, temp, seed) in enumerate(jobs):
        params = SamplingParams(max_new_tokens=6 + 3 * i, temperature=temp, sampling_seed=seed, ignore_eos=True)
        engine.submit(Request(rid=f"r{id(outs)}-{i}", prompt_ids=prompt, params=params, stop_ids=frozenset(),
                              on_output=lambda o, i=i: outs.setdefault(i, []).append(o), return_logprob=True))
    engine._drain_inbox(block=False)
    while engine.scheduler.has_work:
        engine.step()
    result = []
    for i, (prompt, _, _) in enumerate(jobs):
        ids = [t for o in outs[i] for t in o.new_token_ids]
        lps = [x for o in outs[i] for x in o.new_logprobs]
        result.append((prompt + ids, lps, outs[i][-1].cached_tokens))
    return result


def equality_worker(rank: int, world: int, root: str) -> dict:
    from milepost.train.batch import TrainBatch
    from milepost.train.fsdp import FSDPBackend, TrainerSettings
    from milepost.types import Sample

    torch.set_num_threads(1)
    report = {}
    for arch in ("qwen3", "llama"):
        path = str(make_tiny_checkpoint(Path(root) / arch, arch, with_tokenizer=False))
        for dtype in ("float32", "bfloat16"):
            rounds = []
            for on in (True, False):
                engine = _engine(path, dtype, on)
                first = _generate(engine, [(PROMPT_A, 1.0, 1), (PROMPT_B, 0.0, 2), (PROMPT_A[:6], 0.7, 3)])
                second = _generate(engine, [(PROMPT_C, 1.0, 4), (PROMPT_B + [9, 9, 9], 1.0, 5)])
                rounds.append(first + second)
            seqs = rounds[0]
            samples = [Sample(0, i, tokens=t, response_length=len(lp)) for i, (t, lp, _) in enumerate(seqs)]
            for i, (temp, group) in enumerate(((1.0, [0, 3, 4]), (0.7, [2]), (1.0, [1]))):  # greedy: T=1
                backend = FSDPBackend.create(path, TrainerSettings(global_batch_size=len(group), dtype=dtype,
                                                                   true_on_policy=True, temperature=temp, lr=1e-4))
                trainer = backend.compute_logprobs([samples[j] for j in group])
                engine_lp = [torch.tensor(seqs[j][1], dtype=torch.float32) for j in group]
                off_lp = [torch.tensor(rounds[1][j][1], dtype=torch.float32) for j in group]
                batch = TrainBatch([torch.tensor(seqs[j][0]) for j in group], [len(seqs[j][1]) for j in group],
                                   [torch.ones(len(seqs[j][1])) for j in group],
                                   [torch.ones(len(seqs[j][1])) for j in group], rollout_logprobs=engine_lp)
                steps = [backend.train_step(batch)["train_rollout_logprob_abs_diff"] for _ in range(2)]
                report[(arch, dtype, i)] = {
                    "equal": [torch.equal(a, b) for a, b in zip(trainer, engine_lp)],
                    "off_diff": max(float((a - b).abs().max()) for a, b in zip(trainer, off_lp)),
                    "same_tokens": [rounds[0][j][0] == rounds[1][j][0] for j in group],
                    "abs_diff_steps": steps,
                }
            report[(arch, dtype, "cached")] = [c for _, _, c in seqs]
    return report


def test_engine_and_trainer_logprobs_are_bitwise_equal(tmp_path: Path) -> None:
    [report] = run_ranks(equality_worker, 1, str(tmp_path), timeout_s=400)
    for key, value in report.items():
        if key[2] == "cached":
            assert value[3] > 0, f"{key}: round 2 should reuse the cached prefix of prompt A ({value})"
            continue
        assert all(value["equal"]), f"{key}: engine and trainer log-probs differ: {value}"
        # the second step runs after an optimizer step: rollout log-probs are stale, so not 0 there
        assert value["abs_diff_steps"][0] == 0.0, f"{key}: {value}"
        assert value["abs_diff_steps"][1] > 0.0, f"{key}: a step later the policy moved: {value}"
    for dtype in ("float32", "bfloat16"):  # control: without the flag the sampler's numbers differ
        off = [v["off_diff"] for k, v in report.items() if k[1] == dtype and k[2] != "cached"
               and all(v["same_tokens"])]
        assert off and max(off) > 0.0, f"without the flag the {dtype} engine should differ: {off}"


def test_runs_without_a_profile_are_refused(tmp_path: Path) -> None:
    assert profile_refusals("Qwen3ForCausalLM", moe=False, device="cpu", dtype="bfloat16") == []
    cases = {
        "MoE": {"architecture": "Qwen3MoeForCausalLM", "moe": True, "device": "cpu", "dtype": "float32"},
        "no profile for Gemma2": {"architecture": "Gemma2ForCausalLM", "moe": False, "device": "cpu", "dtype": "float32"},
        "fp8": {"architecture": "LlamaForCausalLM", "moe": False, "device": "cuda", "dtype": "bfloat16", "quantization": "fp8"},
        "external": {"architecture": "LlamaForCausalLM", "moe": False, "device": "cpu", "dtype": "float32",
                         "engine_backend": "external"},
        "dtype float32 on cuda": {"architecture": "LlamaForCausalLM", "moe": False, "device": "cuda", "dtype": "float32"},
        "device 'mps'": {"architecture": "LlamaForCausalLM", "moe": False, "device": "mps", "dtype": "float32"},
    }
    for needle, kw in cases.items():
        why = profile_refusals(**kw)
        assert len(why) == 1 and needle in why[0] and "--true-on-policy" in why[0], (needle, why)
    moe = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", with_tokenizer=False)
    with pytest.raises(ValueError, match="MoE model"):
        _engine(str(moe), "float32", True)
    with pytest.raises(ValueError, match="--true-on-policy re-scores"):
        ServerArgs(model_path=moe, true_on_policy=True, quantization="fp8")


def _config_base(tmp_path: Path, architecture: str) -> list[str]:
    model = tmp_path / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    return ["--hf-checkpoint", str(model), "--prompt-data", str(prompts), "--num-rollout", "3",
            "--rollout-batch-size", "4", "--device", "cpu", "--run-dir", str(tmp_path / "run")]


def test_run_config_passes_the_flag_and_refuses_at_start(tmp_path: Path) -> None:
    from milepost.config import ConfigError, load_config
    from milepost.driver.trainer_settings import trainer_settings
    from milepost.launch.local import LocalLauncher

    base = _config_base(tmp_path / "dense", "Qwen3ForCausalLM")
    cfg = load_config(None, [*base, "--true-on-policy", "--dtype", "bfloat16"])
    assert cfg.trainer_cpu_threads == 1  # the engines get the same thread count (reduction order)
    launcher = LocalLauncher(cfg, cfg.run_dir)
    assert "--true-on-policy" in launcher._engine_cmd(30000)
    assert launcher._engine_env(0)["OMP_NUM_THREADS"] == "1"
    assert trainer_settings(cfg).true_on_policy
    assert "--true-on-policy" not in LocalLauncher(load_config(None, base), cfg.run_dir)._engine_cmd(1)
    for extra, needle in (
        (["--engine-quantization", "fp8"], "fp8 serving"),
        (["--engine-backend", "external", "--engine-urls", "http://127.0.0.1:1"], "--engine-backend external"),
        (["--compile-layers"], "--compile-layers"),
    ):
        with pytest.raises(ConfigError, match=needle):
            load_config(None, [*base, "--true-on-policy", *extra])
    moe = _config_base(tmp_path / "moe", "Qwen3MoeForCausalLM")
    with pytest.raises(ConfigError, match="MoE model"):
        load_config(None, [*moe, "--true-on-policy"])


def test_diagnose_mismatch_attributes_a_saved_batch(tmp_path: Path) -> None:
    """A run directory by hand: a qwen3 checkpoint, a saved rollout whose log-probs are the
    engine's sampler's (mode off, bf16), the resolved config. The diagnosis re-creates the gap
    and splits it; with the contract's own numbers as 'saved' the chain up to 'alone' is 0."""
    from milepost.data.rollout_io import save_rollout
    from milepost.models.registry import load_model
    from milepost.onpolicy.contract import sequence_logprobs
    from milepost.onpolicy.mismatch import diagnose
    from milepost.types import Sample

    torch.set_num_threads(1)
    path = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", with_tokenizer=False)
    seqs = _generate(_engine(str(path), "bfloat16", False), [(PROMPT_A, 1.0, 1), (PROMPT_B, 1.0, 2)])
    samples = [Sample(0, i, tokens=t, response_length=len(lp), rollout_logprobs=lp) for i, (t, lp, _) in enumerate(seqs)]
    run = tmp_path / "run"
    save_rollout(run / "rollouts", 0, [samples])
    (run / "config.resolved.toml").write_text(
        f'[model]\nhf_checkpoint = "{path}"\ndtype = "bfloat16"\n[rollout]\nrollout_temperature = 1.0\n'
        f'[debug]\nsave_rollouts = "{run / "rollouts"}"\n')
    result = diagnose(run)
    assert result.tokens == sum(len(lp) for _, lp, _ in seqs)
    assert result.mean_abs("saved", "trainer") > 0.0  # bf16 without the mode: a gap
    assert result.mean_abs("trainer", "fp32") > 0.0  # and precision shows up as its own link
    chain = sum(result.mean_abs(a, b) for a, b in (("saved", "decode"), ("decode", "prefill"), ("prefill", "trainer")))
    assert chain >= result.mean_abs("saved", "trainer") * (1 - 1e-6)
    assert "decode -> prefill" in result.table() and "batch composition" in result.table()
    lm = load_model(path, torch.bfloat16, "cpu")  # the contract's numbers equal the 'alone' row bit for bit
    alone = torch.cat([sequence_logprobs(lm, t, len(lp)) for t, lp, _ in seqs])
    assert torch.equal(alone, result.scores["alone"])
    with pytest.raises(FileNotFoundError, match="config.resolved.toml"):
        diagnose(tmp_path)
