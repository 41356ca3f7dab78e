"""Parallel sizes that do not divide the model or the world are refused with the numbers; the
`milepost convert` command round-trips a checkpoint bit-exactly and refuses bad sizes (exit 2)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from safetensors.torch import load_file

from milepost.cli import main
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.train.megatron.parallel import ParallelSizes, validate_sizes
from milepost.train.megatron.shape import ModelShape

DENSE = ModelShape("qwen3", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                   ffn_hidden_size=128, vocab_size=512, rope_theta=1e6, rms_norm_eps=1e-6,
                   max_position_embeddings=2048, tied_embeddings=True, qk_layernorm=True)
MOE = ModelShape("qwen3_moe", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                 ffn_hidden_size=128, vocab_size=512, rope_theta=1e6, rms_norm_eps=1e-6,
                 max_position_embeddings=2048, tied_embeddings=False, qk_layernorm=True, num_experts=8,
                 moe_top_k=2, moe_ffn_hidden_size=32, moe_layers=(True, True))


@pytest.mark.parametrize("shape,sizes,world,message", [
    (DENSE, ParallelSizes(tp=2), 3, r"world size 3 is not a multiple of tensor x pipeline x context parallel = 2 x 1 x 1 = 2"),
    (DENSE, ParallelSizes(tp=4), 4, r"--tensor-model-parallel-size 4 does not divide the 2 key/value heads"),
    (DENSE, ParallelSizes(tp=8), 8, r"--tensor-model-parallel-size 8 does not divide the 4 attention heads"),
    (DENSE, ParallelSizes(pp=3), 3, r"--pipeline-model-parallel-size 3 does not divide the 2 layers"),
    (DENSE, ParallelSizes(ep=2), 2, r"--expert-model-parallel-size 2: the model has no experts"),
    (MOE, ParallelSizes(ep=3), 3, r"--expert-model-parallel-size 3 does not divide the 8 experts"),
    (MOE, ParallelSizes(ep=4), 2, r"world size 2 is not a multiple of expert x pipeline parallel = 4 x 1"),
    (DENSE, ParallelSizes(tp=0), 1, r"--tensor-model-parallel-size must be >= 1, got 0"),
])
def test_bad_sizes_are_refused_with_numbers(shape, sizes, world, message):
    with pytest.raises(ValueError, match=message):
        validate_sizes(shape, sizes, world)


def test_context_parallel_names_the_missing_package():

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer-engine is installed here")
    with pytest.raises(ValueError, match=r"--context-parallel-size 2 needs the package transformer-engine"):
        validate_sizes(DENSE, ParallelSizes(cp=2), 2)


def test_context_parallel_is_refused_even_with_the_package(monkeypatch):
    """The backend builds megatron's local layers (their attention refuses CP) and splits no
    sequence over CP ranks: with transformer-engine present, CP > 1 is still refused at start."""
    import milepost.train.megatron.parallel as parallel

    real = importlib.util.find_spec
    monkeypatch.setattr(parallel.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "transformer_engine" else real(name, *a))
    with pytest.raises(ValueError, match=r"--context-parallel-size 2: context parallel is not wired"):
        validate_sizes(DENSE, ParallelSizes(cp=2), 2)
    validate_sizes(DENSE, ParallelSizes(cp=1), 2)


def test_missing_megatron_core_is_refused_naming_the_package(monkeypatch):
    """Without megatron-core: `MegatronBackend.create` (ImportError) and the run config (ValueError,
    with the other refusals) name the package and the install command."""
    import milepost.train.megatron.provider as provider
    from milepost.train.megatron.preflight import check_train_backend

    real = importlib.util.find_spec
    monkeypatch.setattr(provider.importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] == "megatron" else real(name, *a))
    with pytest.raises(ImportError, match=r"needs the package megatron-core.*pip install 'milepost\[megatron\]'"):
        provider.require_megatron()

    class Cfg:
        train_backend = "megatron"

    with pytest.raises(ValueError, match=r"--train-backend megatron needs the package megatron-core.*pip install"):
        check_train_backend(Cfg())


def test_good_sizes_pass():
    validate_sizes(DENSE, ParallelSizes(tp=2), 4)
    validate_sizes(MOE, ParallelSizes(tp=2, ep=4), 4)
    validate_sizes(DENSE, ParallelSizes(tp=2, pp=2), 4)
    assert ParallelSizes(tp=2).data_parallel(8) == 4


def test_convert_command_round_trip(tmp_path, capsys):
    src = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", with_tokenizer=False)
    assert main(["convert", "hf-to-megatron", str(src), str(tmp_path / "meg"), "--tensor-model-parallel-size", "2",
                 "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]) == 0
    rank = tmp_path / "meg" / "release" / "mp_rank_01_001_001" / "model_optim_rng.pt"
    piece = torch.load(rank, weights_only=True)["model"]
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight" in piece  # 8 experts / EP 2
    assert "embedding.word_embeddings.weight" not in piece  # the last stage has no embedding
    assert main(["convert", "megatron-to-hf", str(tmp_path / "meg"), str(tmp_path / "back")]) == 0
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert main(["convert", "hf-to-megatron", str(src), str(tmp_path / "bad"), "--tensor-model-parallel-size", "3"]) == 2
    assert "--tensor-model-parallel-size 3 does not divide the 4 attention heads" in capsys.readouterr().out
    assert main(["convert", "megatron-to-hf", str(src), str(tmp_path / "x")]) == 2


@pytest.mark.parametrize("overrides,sizes,shape,message", [
    ({"lora_rank": 8}, ParallelSizes(), DENSE, r"lora_rank=8 is not available with --train-backend megatron yet"),
    ({"critic_lr": 1e-5}, ParallelSizes(), DENSE, r"critic_lr=1e-05 is not available"),
    ({"use_rollout_routing_replay": True}, ParallelSizes(), DENSE, r"--use-rollout-routing-replay: the model is a dense"),
    ({"activation_checkpointing": "layer"}, ParallelSizes(), DENSE, r"set activation_checkpointing='none'"),
    ({"use_rollout_routing_replay": True}, ParallelSizes(pp=2), MOE, r"replaying routes on pipeline stages"),
    ({"dtype": "bfloat16"}, ParallelSizes(), DENSE, r"dtype='bfloat16' on device='cpu'"),
    ({"precision": "fp8_block"}, ParallelSizes(), DENSE, r"precision='fp8_block' with --train-backend megatron"),
    ({"use_rollout_routing_replay": True}, ParallelSizes(tp=2, ep=2), MOE, r"replaying routes under sequence par"),
])
def test_backend_refuses_what_it_lacks(overrides, sizes, shape, message):
    from milepost.train.megatron.backend import refuse_unsupported
    from milepost.train.settings import TrainerSettings

    with pytest.raises(ValueError, match=message):
        refuse_unsupported(TrainerSettings(**overrides), sizes, shape)
    refuse_unsupported(TrainerSettings(), ParallelSizes(tp=2), DENSE)  # what it has passes
    refuse_unsupported(TrainerSettings(), ParallelSizes(tp=2, ep=2), MOE)
    refuse_unsupported(TrainerSettings(), ParallelSizes(pp=2), MOE)


def test_run_config_refuses_bad_backend_settings(tmp_path):
    """`milepost train` flags: checked when the config is built, before any process starts."""
    from milepost.config import load_config
    from milepost.testing.run_args import stub_run_args

    model = make_tiny_checkpoint(tmp_path / "model_dir", "qwen3", with_tokenizer=False)

    def load(*flags: str):
        args = stub_run_args(tmp_path, "--num-rollout", "1", "--rollout-batch-size", "8", *flags)
        args[args.index("--hf-checkpoint") + 1] = str(model)
        return load_config(None, args)

    with pytest.raises(ValueError, match=r"--tensor-model-parallel-size need --train-backend megatron"):
        load("--tensor-model-parallel-size", "2")
    with pytest.raises(ValueError, match=r"--tensor-model-parallel-size 8 does not divide the 4 attention heads"):
        load("--train-backend", "megatron", "--tensor-model-parallel-size", "8", "--actor-num-gpus-per-node", "8")
    with pytest.raises(ValueError, match=r"world size 3 is not a multiple"):
        load("--train-backend", "megatron", "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "3")
    with pytest.raises(ValueError, match=r"--lora-rank 8 is not available with --train-backend megatron"):
        load("--train-backend", "megatron", "--lora-rank", "8")
    for precision in ("fp8", "int4"):  # the trainer would run bf16 under a quantized contract
        with pytest.raises(ValueError, match=rf"--precision {precision} .* with --train-backend megatron"):
            load("--train-backend", "megatron", "--precision", precision)
    if importlib.util.find_spec("megatron") is not None:
        cfg = load("--train-backend", "megatron", "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2")
        assert (cfg.train_backend, cfg.tensor_model_parallel_size) == ("megatron", 2)
        cfg = load("--train-backend", "megatron", "--pipeline-model-parallel-size", "2", "--actor-num-gpus-per-node", "2")
        assert cfg.pipeline_model_parallel_size == 2  # pipeline parallel is accepted now


def test_distributed_optimizer_needs_the_megatron_backend():
    """--use-distributed-optimizer with --train-backend fsdp is refused when the config is built and
    by create_backend, naming the setting."""
    from milepost.train.backend import create_backend
    from milepost.train.megatron.preflight import check_train_backend
    from milepost.train.settings import TrainerSettings

    class Cfg:
        train_backend = "fsdp"
        tensor_model_parallel_size = pipeline_model_parallel_size = 1
        context_parallel_size = expert_model_parallel_size = 1
        use_distributed_optimizer = True

    with pytest.raises(ValueError, match=r"--use-distributed-optimizer needs --train-backend megatron"):
        check_train_backend(Cfg())
    with pytest.raises(ValueError, match=r"use_distributed_optimizer=True needs --train-backend megatron"):
        create_backend("unused", TrainerSettings(use_distributed_optimizer=True), "fsdp")
