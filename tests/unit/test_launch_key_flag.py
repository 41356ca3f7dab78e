"""An API key that starts with "-" reaches the engine and the router intact: the launchers pass
it as `--api-key=KEY` (a per-run key from token_urlsafe started with "-" about 1 run in 64, and
`milepost serve` then stopped with "expected one argument")."""

from __future__ import annotations

from pathlib import Path

from milepost.cli import build_parser
from milepost.config import TrainConfig
from milepost.launch.local import LocalLauncher

KEY = "-starts-like-a-flag-0123456789abcdef"


def _cfg() -> TrainConfig:
    # The real config with its defaults (unvalidated: the checkpoint does not exist), so every
    # setting the launcher reads is there as it grows.
    return TrainConfig.model_construct(
        hf_checkpoint="/models/m", engine_mem_fraction_static=0.8, engine_page_size=16, seed=1,
        engine_max_total_tokens=2048, api_key=KEY, dtype="float32", device="cpu")


def test_the_engine_command_parses_a_key_that_looks_like_a_flag(tmp_path: Path) -> None:
    cmd = LocalLauncher(_cfg(), tmp_path)._engine_cmd(30000)
    serve = cmd[cmd.index("serve"):]
    ns = build_parser().parse_args(serve)
    assert ns.api_key == KEY
