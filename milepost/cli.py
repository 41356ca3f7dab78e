"""`milepost <command> ...`: parse flags into a typed config and hand it to the component.

Each command is one `_add_<name>(subparsers)` function that declares its flags and a `run`
handler; register it in `COMMANDS`. Handlers import their component lazily so `--help` is fast.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

from milepost.engine.server_args import ServerArgs
from milepost.flags import add_model_flags, model_from_namespace


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="start the embedded SGLang-compatible inference server",
        description="Serve a local Hugging Face model over SGLang's HTTP protocol.",
    )
    add_model_flags(parser, ServerArgs)

    def run(ns: argparse.Namespace) -> int:
        args = model_from_namespace(ServerArgs, ns, parser)
        logging.basicConfig(
            level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        from milepost.engine.server import run_server

        run_server(args)
        return 0

    parser.set_defaults(run=run)


def _add_tiny_model(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tiny-model",
        help="write a tiny random Hugging Face checkpoint (with tokenizer) for first runs and tests",
        description="Build a tiny random checkpoint locally; nothing is downloaded.",
    )
    parser.add_argument("path", help="directory to write (created if missing)")
    parser.add_argument("--arch", choices=["llama", "qwen3", "qwen3_moe"], default="qwen3")
    parser.add_argument("--seed", type=int, default=0)

    def run(ns: argparse.Namespace) -> int:
        from milepost.testing.checkpoints import make_tiny_checkpoint

        path = make_tiny_checkpoint(ns.path, ns.arch, seed=ns.seed)
        print(f"wrote a tiny {ns.arch} checkpoint to {path}")
        return 0

    parser.set_defaults(run=run)


COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_serve, _add_tiny_model)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="milepost", description="RL post-training for language models.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `milepost` script; returns the process exit code."""
    ns = build_parser().parse_args(argv)
    return ns.run(ns)
