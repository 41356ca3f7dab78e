"""Start-time checks of `ServerArgs`' speculative-decoding settings (docs/speculative.md).

Called from `ServerArgs`' model validator: a setting without its algorithm, a draft model where
the algorithm takes none (or none where it needs one), and NEXTN / EAGLE without the target's own
multi-token-prediction layers are refused before anything loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from milepost.engine.server_args import ServerArgs


def check_speculative(args: ServerArgs) -> None:
    """Speculative settings need their algorithm, and a draft its own vocabulary's match."""
    algo, draft = args.speculative_algorithm, args.speculative_draft_model_path
    tuned = (args.speculative_num_draft_tokens != 4
             or args.speculative_ngram_min_match_window_size != 2
             or args.speculative_ngram_max_match_window_size != 8
             or args.speculative_ngram_scope != "prompt"
             or args.speculative_ngram_capacity != 1 << 18
             or not args.speculative_ngram_measured_rest)
    eagle = (args.speculative_num_steps, args.speculative_eagle_topk) != (None, None)
    if algo is None and (draft is not None or tuned or eagle):
        raise ValueError("--speculative-draft-model-path / --speculative-num-draft-tokens / "
                         "--speculative-num-steps / --speculative-eagle-topk / --speculative-ngram-* "
                         "need --speculative-algorithm NGRAM, STANDALONE or NEXTN")
    if algo in ("NEXTN", "EAGLE"):
        check_nextn(args)
    elif eagle:
        raise ValueError(f"--speculative-num-steps / --speculative-eagle-topk are NEXTN / EAGLE "
                         f"settings; with --speculative-algorithm {algo} use "
                         "--speculative-num-draft-tokens")
    if algo == "STANDALONE" and draft is None:
        raise ValueError("--speculative-algorithm STANDALONE needs --speculative-draft-model-path "
                         "DIR (a small model with the target's vocabulary)")
    if algo == "NGRAM" and draft is not None:
        raise ValueError("--speculative-algorithm NGRAM uses no draft model: drop "
                         "--speculative-draft-model-path or use STANDALONE")
    if args.speculative_ngram_min_match_window_size > args.speculative_ngram_max_match_window_size:
        raise ValueError("--speculative-ngram-min-match-window-size exceeds "
                         "--speculative-ngram-max-match-window-size")
    if algo not in (None, "NGRAM") and args.overlap_schedule == "on":
        raise ValueError(f"--speculative-algorithm {algo} needs each step's tokens on the host to "
                         "propose the next ones: drop --overlap-schedule on (auto turns it off; "
                         "NGRAM takes it for the steps it rests)")
    if draft is not None:
        from milepost.engine.speculative_setup import check_draft_dir

        check_draft_dir(args.model_path, draft)


def check_nextn(args: ServerArgs) -> None:
    """NEXTN / EAGLE draft with the target checkpoint's own MTP layers: they must be there."""
    algo = args.speculative_algorithm
    draft = args.speculative_draft_model_path
    if draft is not None and Path(draft).resolve() != Path(args.model_path).resolve():
        raise ValueError(f"--speculative-algorithm {algo} drafts with the target's own multi-token-"
                         "prediction layers; a separate EAGLE head (--speculative-draft-model-path "
                         f"{draft}) is not supported: drop the path, or use STANDALONE for a draft model")
    if args.model_impl == "transformers":
        raise ValueError(f"--speculative-algorithm {algo} runs the native model's MTP layers; "
                         "--model-impl transformers has none: use auto or native")
    if args.speculative_eagle_topk not in (None, 1):
        raise ValueError(f"--speculative-eagle-topk {args.speculative_eagle_topk}: only 1 (a chain of "
                         "proposals) is implemented; pass --speculative-eagle-topk 1")
    steps = args.speculative_num_steps
    if steps is not None and "speculative_num_draft_tokens" in args.model_fields_set:
        if args.speculative_num_draft_tokens != steps + 1:
            raise ValueError(f"--speculative-num-steps {steps} with --speculative-eagle-topk 1 verifies "
                             f"{steps + 1} tokens, but --speculative-num-draft-tokens is "
                             f"{args.speculative_num_draft_tokens}: pass {steps + 1} or drop one of them")
    from milepost.engine.speculative_setup import check_mtp_checkpoint

    check_mtp_checkpoint(args.model_path, algo)
