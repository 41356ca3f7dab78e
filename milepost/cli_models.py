"""`milepost models`: which architectures run natively, which through the transformers fallback.

Without arguments it prints the table of milepost/models/support.py (`--markdown` for the README);
`--check DIR` says which path a checkpoint directory would take and why, reading only its config;
`--all` lists every causal LM transformers has, marking those the fallback cannot drive.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from milepost.models.support import ARCHS, FALLBACK, NATIVE, NOT_YET, markdown_table


def add_models_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models", help="architectures: native or transformers fallback, and their features",
        description="List the architectures milepost serves and trains, natively or through the "
        "transformers fallback (exact, slower), with feature support; see docs/models.md.")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--check", metavar="DIR", help="say which path this checkpoint takes and why")
    parser.add_argument("--trust-remote-code", action="store_true", help="with --check: allow auto_map")
    parser.add_argument("--all", action="store_true",
                        help="also list every transformers causal LM (untested unless in the table)")
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    if ns.check:
        return _check(Path(ns.check), ns.trust_remote_code)
    if ns.markdown:
        print(markdown_table(), end="")
    else:
        print(f"{'architecture':22} {'path':13} {'R3':13} {'fp8':13} notes")
        for a in ARCHS:
            print(f"{a.name:22} {a.path:13} {a.r3:13} {a.fp8:13} {a.notes}")
        print(f"true on-policy: Qwen3, Llama (docs/true_on_policy.md). LoRA: {NOT_YET}. Any other transformers causal LM: {FALLBACK} (untested); "
              "`milepost models --check DIR` for a checkpoint")
    if ns.all:
        known = {a.name for a in ARCHS}
        for name, ok in _transformers_causal_lms():
            if name not in known:
                print(f"{name:40} {FALLBACK + ' (untested)' if ok else 'refused: no attention interface'}")
    return 0


def _check(path: Path, trust_remote_code: bool) -> int:
    """Config only (no weights): the path `load_model` would take, with the reason."""
    from milepost.models.hf_fallback import unsupported_reason
    from milepost.models.registry import checkpoint_config, native_reason

    try:
        config = checkpoint_config(path, trust_remote_code)
    except (ValueError, OSError) as e:
        print(f"{path}: refused: {e}")
        return 1
    arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    reason = "custom code (auto_map)" if getattr(config, "auto_map", None) else native_reason(config)
    if reason is None:
        print(f"{path}: {arch}: {NATIVE}")
        return 0
    from milepost.models.hf_fallback import _model_class

    try:
        refusal = unsupported_reason(config, _model_class(config, trust_remote_code))
    except ValueError as e:
        refusal = str(e)
    if refusal is not None:
        print(f"{path}: {arch}: refused: {refusal}")
        return 1
    print(f"{path}: {arch}: {FALLBACK} (exact, slower), because: {reason}")
    return 0


def _transformers_causal_lms() -> list[tuple[str, bool]]:
    """(class name, drives attention through the interface) for every transformers causal LM,
    read from the modeling sources (importing ~300 modeling modules would take minutes)."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type, name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        module = model_type_to_module_name(model_type)
        spec = importlib.util.find_spec(f"transformers.models.{module}")
        source = None
        if spec is not None and spec.submodule_search_locations:
            candidate = Path(list(spec.submodule_search_locations)[0]) / f"modeling_{module}.py"
            source = candidate.read_text() if candidate.exists() else None
        out.append((name, bool(source) and "_supports_attention_backend = True" in source))
    return out
