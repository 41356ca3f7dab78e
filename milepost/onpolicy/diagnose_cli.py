"""`milepost diagnose mismatch RUN_DIR [--step N] [--model PATH]`: the mismatch attribution table.

Prints, for one saved rollout batch of a run (--save-rollouts), how much each link from the
engine's computation to the trainer's moves the log-probs (milepost/onpolicy/mismatch.py).
"""

from __future__ import annotations

import argparse


def add_diagnose_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "diagnose", help="diagnostics of a run (mismatch: where train_rollout_logprob_abs_diff comes from)",
        description="Diagnostics of a finished or running `milepost train` run directory.")
    kinds = parser.add_subparsers(dest="diagnose", metavar="WHAT", required=True)
    mismatch = kinds.add_parser(
        "mismatch", help="attribute the train-rollout log-prob gap to its sources",
        description="Re-score one saved rollout batch (the run needs --save-rollouts) along a chain "
        "engine decode -> engine prefill -> trainer forward, same vs different batch composition, "
        "run dtype vs float32, and print how much each link explains. Runs on CPU.")
    mismatch.add_argument("run_dir", help="a `milepost train` run directory (holds config.resolved.toml)")
    mismatch.add_argument("--step", type=int, default=0, help="which saved rollout (default 0)")
    mismatch.add_argument("--model", default=None, help="weights that generated that rollout "
                          "(default: the run's --hf-checkpoint, i.e. those of step 0)")
    mismatch.add_argument("--max-samples", type=int, default=64, help="samples re-scored (default 64)")

    def run(ns: argparse.Namespace) -> int:
        from milepost.onpolicy.mismatch import diagnose

        if ns.max_samples < 1:
            mismatch.error(f"--max-samples must be >= 1, got {ns.max_samples}")
        try:
            result = diagnose(ns.run_dir, ns.step, ns.model, ns.max_samples)
        except (FileNotFoundError, ValueError) as err:
            mismatch.error(str(err))  # exits 2, naming the input at fault
        print(result.table())
        return 0

    mismatch.set_defaults(run=run)
