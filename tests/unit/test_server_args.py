"""`milepost serve` flags: defaults, aliases, and errors that name the flag and the fix."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from milepost.cli import build_parser, main
from milepost.engine.server_args import ServerArgs
from milepost.flags import model_to_argv


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "max_position_embeddings": 4096}))
    return d


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[ServerArgs]:
    """Stands in for milepost.engine.server (written elsewhere); records what serve passes."""
    calls: list[ServerArgs] = []
    fake = types.ModuleType("milepost.engine.server")
    fake.run_server = calls.append  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "milepost.engine.server", fake)
    return calls


def _serve(argv: list[str], served: list[ServerArgs]) -> ServerArgs:
    assert main(["serve", *argv]) == 0
    assert len(served) == 1
    return served[0]


def test_defaults(model_dir: Path, served: list[ServerArgs]) -> None:
    args = _serve(["--model", str(model_dir)], served)
    assert args.model_path == model_dir
    assert args.tokenizer_path is None
    assert (args.host, args.port) == ("127.0.0.1", 30000)
    assert (args.dtype, args.device) == ("auto", "auto")
    assert args.mem_fraction_static == 0.85
    assert args.max_total_tokens is None and args.cpu_kv_cache_gb == 1.0
    assert args.page_size == 16
    assert args.context_length is None and args.chunked_prefill_size is None
    assert args.max_running_requests == 256
    assert args.disable_radix_cache is False
    assert args.random_seed == 0
    assert args.weight_version == "default"
    assert args.log_level == "info"


def test_model_path_alias_and_values(model_dir: Path, served: list[ServerArgs]) -> None:
    args = _serve(
        [
            "--model-path", str(model_dir), "--port", "31001", "--dtype", "bfloat16",
            "--device", "cpu", "--mem-fraction-static", "0.5", "--max-total-tokens", "4096",
            "--page-size", "32", "--context-length", "1024", "--chunked-prefill-size", "256",
            "--max-running-requests", "8", "--disable-radix-cache", "--random-seed", "7",
            "--weight-version", "v3", "--log-level", "debug", "--tokenizer-path", str(model_dir),
        ],
        served,
    )
    assert args.model_path == model_dir and args.tokenizer_path == model_dir
    assert (args.port, args.dtype, args.device) == (31001, "bfloat16", "cpu")
    assert (args.mem_fraction_static, args.max_total_tokens, args.page_size) == (0.5, 4096, 32)
    assert (args.context_length, args.chunked_prefill_size, args.max_running_requests) == (1024, 256, 8)
    assert args.disable_radix_cache is True
    assert (args.random_seed, args.weight_version, args.log_level) == (7, "v3", "debug")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--mem-fraction-static", "1.5"], "--mem-fraction-static must be in (0, 1); got 1.5"),
        (["--mem-fraction-static", "0"], "--mem-fraction-static must be in (0, 1); got 0.0"),
        (["--port", "0"], "--port must be in [1, 65535]; got 0"),
        (["--port", "70000"], "--port must be in [1, 65535]; got 70000"),
        (["--port", "abc"], "argument --port: invalid int value: 'abc'"),
        (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
        (["--page-size", "0"], "--page-size must be >= 1; got 0"),
        (["--max-total-tokens", "0"], "--max-total-tokens must be >= 1; got 0"),
        (["--max-total-tokens", "8"], "--max-total-tokens (8) must hold at least one page of --page-size (16)"),
        (["--context-length", "-5"], "--context-length must be >= 1; got -5"),
        (["--context-length", "8192"], "--context-length 8192 exceeds the model's max_position_embeddings (4096)"),
        (["--chunked-prefill-size", "0"], "--chunked-prefill-size must be >= 1; got 0"),
        (["--max-running-requests", "0"], "--max-running-requests must be >= 1; got 0"),
        (["--cpu-kv-cache-gb", "0"], "--cpu-kv-cache-gb must be > 0; got 0.0"),
        (["--random-seed", "-1"], "--random-seed must be in [0, 2**63); got -1"),
        (["--weight-version", ""], "--weight-version must not be empty"),
        (["--host", " "], "--host must not be empty"),
        (["--tokenizer-path", "/no/such/tok"], "--tokenizer-path /no/such/tok is not a directory"),
        (["--bogus", "1"], "unrecognized arguments: --bogus"),
    ],
)
def test_invalid_values_name_the_flag(
    flags: list[str], expected: str, model_dir: Path, served: list[ServerArgs], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", str(model_dir), *flags])
    assert exc.value.code == 2
    assert expected in capsys.readouterr().err
    assert served == []


def test_missing_model_dir(tmp_path: Path, served: list[ServerArgs], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--model", str(tmp_path / "absent")])
    err = capsys.readouterr().err
    assert f"--model-path {tmp_path / 'absent'} is not a directory" in err
    assert "local Hugging Face model directory" in err

    with pytest.raises(SystemExit):
        main(["serve", "--model", str(tmp_path)])  # exists, but no config.json
    assert f"--model-path {tmp_path} has no config.json" in capsys.readouterr().err

    with pytest.raises(SystemExit):
        main(["serve"])
    assert "the following arguments are required: --model-path/--model" in capsys.readouterr().err
    assert served == []


def test_bad_config_json_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SystemExit):
        main(["serve", "--model", str(tmp_path)])
    assert "config.json is not valid JSON" in capsys.readouterr().err


def test_resolved_on_cpu(model_dir: Path) -> None:
    args = ServerArgs(model_path=model_dir, device="cpu").resolved()
    assert (args.device, args.dtype) == ("cpu", "float32")
    assert args.tokenizer_path == model_dir
    assert args.context_length == 4096
    assert args.chunked_prefill_size == 512
    import torch

    assert args.torch_dtype() is torch.float32
    explicit = ServerArgs(model_path=model_dir, device="cpu", dtype="bfloat16", context_length=100,
                          chunked_prefill_size=64).resolved()
    assert (explicit.dtype, explicit.context_length, explicit.chunked_prefill_size) == ("bfloat16", 100, 64)
    assert args.overlap_schedule == "off", "auto: the overlap schedule is for CUDA"
    on = ServerArgs(model_path=model_dir, device="cpu", overlap_schedule="on").resolved()
    assert on.overlap_schedule == "on"


def test_resolved_refuses_cuda_without_cuda(model_dir: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="--device cuda was given but CUDA is not available"):
        ServerArgs(model_path=model_dir, device="cuda").resolved()


def test_kv_pool_tokens(model_dir: Path) -> None:
    cpu = ServerArgs(model_path=model_dir, device="cpu", cpu_kv_cache_gb=0.001)
    # 0.001 GiB = 1073741 bytes; 1000 bytes/token -> 1073 tokens -> 1072 (whole pages of 16)
    assert cpu.kv_pool_tokens(kv_bytes_per_token=1000) == 1072
    fixed = ServerArgs(model_path=model_dir, max_total_tokens=100, page_size=16)
    assert fixed.kv_pool_tokens(kv_bytes_per_token=1000) == 96
    cuda = ServerArgs(model_path=model_dir, device="cuda")
    assert cuda.kv_pool_tokens(kv_bytes_per_token=10, cuda_kv_budget_bytes=10_000) == 992
    with pytest.raises(ValueError, match="needs cuda_kv_budget_bytes"):
        cuda.kv_pool_tokens(kv_bytes_per_token=10)
    with pytest.raises(ValueError, match="raise --cpu-kv-cache-gb or --max-total-tokens"):
        cpu.kv_pool_tokens(kv_bytes_per_token=10**9)
    with pytest.raises(ValueError, match="call resolved\\(\\) first"):
        ServerArgs(model_path=model_dir).kv_pool_tokens(kv_bytes_per_token=1000)


def test_programmatic_errors_name_the_flag(model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"--mem-fraction-static must be in \(0, 1\); got 1.5"):
        ServerArgs(model_path=model_dir, mem_fraction_static=1.5)
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        ServerArgs(model_path=model_dir, mem_fraction=0.5)  # type: ignore[call-arg]


def test_argv_round_trip(model_dir: Path, served: list[ServerArgs]) -> None:
    original = ServerArgs(model_path=model_dir, port=31234, disable_radix_cache=True, weight_version="w1")
    argv = model_to_argv(original)
    assert argv[:2] == ["--model-path", str(model_dir)]
    assert "--host" not in argv  # defaults are not repeated
    assert _serve(argv, served) == original


def test_help_lists_serve(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--help"])
    assert exc.value.code == 0
    assert "serve" in capsys.readouterr().out
