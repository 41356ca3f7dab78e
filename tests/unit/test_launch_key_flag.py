"""An API key that starts with "-" reaches the engine and the router intact: the launchers pass
it as `--api-key=KEY` (a per-run key from token_urlsafe started with "-" about 1 run in 64, and
`milepost serve` then stopped with "expected one argument")."""

from __future__ import annotations

import types
from pathlib import Path

from milepost.cli import build_parser
from milepost.launch.local import LocalLauncher

KEY = "-starts-like-a-flag-0123456789abcdef"


def _cfg() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        hf_checkpoint="/models/m", engine_mem_fraction_static=0.8, engine_page_size=16, seed=1,
        engine_max_total_tokens=2048, engine_quantization=None, lora_rank=0, adapters=None,
        true_on_policy=False, api_key=KEY, engine_backend="embedded", dtype="float32",
        device="cpu", precision="bf16", train_precision=None, rollout_precision=None,
        precision_override=None, nvfp4_four_over_six=False, engine_kv_cache_dtype=None)


def test_the_engine_command_parses_a_key_that_looks_like_a_flag(tmp_path: Path) -> None:
    cmd = LocalLauncher(_cfg(), tmp_path)._engine_cmd(30000)
    serve = cmd[cmd.index("serve"):]
    ns = build_parser().parse_args(serve)
    assert ns.api_key == KEY
