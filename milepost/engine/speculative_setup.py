"""Start-up of speculative decoding: the draft directory's checks, its model, and the Speculator.

A draft model must speak the target's vocabulary: the same `vocab_size` in config.json and, where
both directories ship a tokenizer.json, the same token-to-id map; anything else is refused at
start (a proposal in another vocabulary would be verified as the wrong tokens, wasting every
step). The draft's KV pools take the target's block count, so its bytes per token are added to
the target's when the pool is sized (setup.py). Its weights are updated with the target's
under `draft/<name>` (install_draft_names). NEXTN drafts with the target checkpoint's own MTP
layers (draft_mtp.py): refused at start for a checkpoint without them; their weights are the
target's, under the checkpoint's names.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from milepost.engine.draft_model import DraftModel
from milepost.engine.draft_mtp import MtpDrafter
from milepost.engine.draft_ngram import NgramDrafter
from milepost.engine.server_args import ServerArgs
from milepost.engine.speculative import Speculator
from milepost.models.base import CausalLM
from milepost.models.masked_attention import needs_variant_backend


def check_draft_dir(model_path: Path, draft_path: Path) -> None:
    """Refuse a draft directory that is missing, broken, or of another vocabulary than the target."""
    flag = "--speculative-draft-model-path"
    if not Path(draft_path).is_dir() or not (Path(draft_path) / "config.json").is_file():
        raise ValueError(f"{flag} {draft_path} is not a Hugging Face model directory (no config.json)")
    ours, theirs = _vocab_size(model_path), _vocab_size(draft_path)
    if ours is not None and theirs is not None and ours != theirs:
        raise ValueError(f"{flag} {draft_path} has vocab_size {theirs}, the target {model_path} "
                         f"{ours}: a draft must use the target's vocabulary")
    a, b = _tokenizer_vocab(model_path), _tokenizer_vocab(draft_path)
    if a is not None and b is not None and a != b:
        differ = sorted(set(a.items()) ^ set(b.items()))[:3]
        raise ValueError(f"{flag} {draft_path}: its tokenizer maps tokens to other ids than the "
                         f"target's (e.g. {differ}); a draft must use the target's vocabulary")


def check_mtp_checkpoint(model_path: Path, algo: str) -> None:
    """Refuse NEXTN / EAGLE for a checkpoint whose architecture or weights have no MTP layers."""
    problem = mtp_checkpoint_problem(model_path)
    if problem is not None:
        raise ValueError(f"--speculative-algorithm {algo} drafts with the checkpoint's own multi-token-"
                         f"prediction (MTP) layers, but {problem}: use a checkpoint that ships them, "
                         "or drop --speculative-algorithm or use NGRAM / STANDALONE "
                         "--speculative-draft-model-path DIR")


def mtp_checkpoint_problem(model_path: Path) -> str | None:
    """Why `model_path` cannot draft with its own MTP layers (None when it can)."""
    from types import SimpleNamespace

    from milepost.models.mtp import mtp_layers_in_checkpoint
    from milepost.models.registry import MODEL_REGISTRY

    raw = json.loads((Path(model_path) / "config.json").read_text())  # read, no custom code run
    arch = (raw.get("architectures") or ["?"])[0]
    cls = MODEL_REGISTRY.get(arch)
    if cls is None or not getattr(cls, "supports_mtp", False):
        return f"{arch} ({model_path}) has no native MTP support (DeepseekV3ForCausalLM has)"
    # transformers' DeepseekV3Config defaults num_nextn_predict_layers to 1 (the weights decide).
    n = raw.get("num_nextn_predict_layers", 1)
    config = SimpleNamespace(num_hidden_layers=raw.get("num_hidden_layers", 0), num_nextn_predict_layers=n)
    if mtp_layers_in_checkpoint(model_path, config) == 0:
        return (f"{model_path} has no multi-token-prediction weights (config num_nextn_predict_layers="
                f"{n}, no model.layers.{config.num_hidden_layers}.* tensors)")
    return None


def mtp_kv_bytes_per_token(args: ServerArgs, target: CausalLM, kv_dtype: torch.dtype) -> int:
    """Bytes one token of the NEXTN draft's MTP cache takes (0 for other algorithms)."""
    if args.speculative_algorithm not in ("NEXTN", "EAGLE"):
        return 0
    elem = torch.empty((), dtype=kv_dtype).element_size()
    return (2 if getattr(target, "kv_values", True) else 1) * target.num_kv_heads * target.head_dim * elem


def load_draft(args: ServerArgs, dtype: torch.dtype, device: torch.device) -> CausalLM | None:
    """The STANDALONE draft model on the device, or None for other algorithms."""
    if args.speculative_algorithm != "STANDALONE":
        return None
    from milepost.models.registry import load_model

    assert args.speculative_draft_model_path is not None  # validated by ServerArgs
    draft = load_model(args.speculative_draft_model_path, dtype, device, backend=args.model_impl,
                       trust_remote_code=args.trust_remote_code)
    fuse = getattr(draft, "fuse_projections", None)
    if fuse is not None:  # as the target: one GEMM for q/k/v and one for gate/up
        fuse()
    return draft


def draft_kv_bytes_per_token(draft: CausalLM | None, kv_dtype: torch.dtype) -> int:
    """Bytes one token of the draft's KV takes over all its layers (0 without a draft)."""
    if draft is None:
        return 0
    elem = torch.empty((), dtype=kv_dtype).element_size()
    kv_values = getattr(draft, "kv_values", True)
    return (2 if kv_values else 1) * draft.num_layers * draft.num_kv_heads * draft.head_dim * elem


def make_speculator(args: ServerArgs, target: CausalLM, draft: CausalLM | None, num_blocks: int,
                    kv_dtype: torch.dtype, device: torch.device, cuda_graph_max_bs: int = 0,
                    context_length: int | None = None) -> Speculator | None:
    """The engine's Speculator for resolved args (None without --speculative-algorithm); a draft
    model's weights become addressable through the target's as `draft/<name>`."""
    if args.speculative_algorithm is None:
        return None
    if args.speculative_algorithm == "NGRAM":
        drafter: NgramDrafter | DraftModel | MtpDrafter = NgramDrafter(
            args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size,
            args.speculative_ngram_scope, args.speculative_ngram_capacity)
    elif args.speculative_algorithm in ("NEXTN", "EAGLE"):
        drafter = MtpDrafter(target, num_blocks, args.page_size, kv_dtype, device, args.attention_backend,
                             catch_up_tokens=args.chunked_prefill_size or 512)
    else:
        assert draft is not None
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"--speculative-draft-model-path: the draft's embedding has "
                             f"{draft.vocab_size} tokens, the target's {target.vocab_size}")
        install_draft_names(target, draft)
        # Draft graphs only where the target's are on and the draft is as graph-safe (cuda_graph_max_bs
        # is 0 otherwise): dense, or MoE in bf16, and no per-sequence (windowed) attention.
        safe = not needs_variant_backend(draft) and (draft.moe_top_k == 0 or
                                                     next(draft.parameters()).dtype == torch.bfloat16)
        drafter = DraftModel(draft, num_blocks, args.page_size, kv_dtype, device,
                             args.attention_backend, catch_up_tokens=args.chunked_prefill_size or 512,
                             cuda_graph_max_bs=cuda_graph_max_bs if safe else 0,
                             context_length=context_length)
        drafter.capture_cuda_graphs()
    # N-gram steps that propose nothing rest from proposing, overlapped, where the schedule is on.
    can_rest = isinstance(drafter, NgramDrafter) and args.overlap_schedule == "on"
    return Speculator(args.verified_tokens(), drafter, can_rest=can_rest,
                      measured_rest=args.speculative_ngram_measured_rest)


DRAFT_PREFIX = "draft/"


def install_draft_names(target: CausalLM, draft: CausalLM) -> None:
    """Let the target's `weight_view` / `hf_weight_names` address the draft's tensors as
    `draft/<name>`: every weight-update path (tensor, distributed, p2p) writes them when the
    trainer sends them, and `/weights_checksum` lists them, so a draft left stale is seen by the
    weight check. A checkpoint on disk need not hold them (names with '/' are not a checkpoint's)."""
    base_view = target.weight_view
    base_names = target.hf_weight_names

    def weight_view(name: str) -> torch.Tensor:
        if name.startswith(DRAFT_PREFIX):
            return draft.weight_view(name[len(DRAFT_PREFIX):])
        return base_view(name)

    def hf_weight_names() -> list[str]:
        return base_names() + [DRAFT_PREFIX + n for n in draft.hf_weight_names()]

    target.weight_view = weight_view  # type: ignore[method-assign]
    target.hf_weight_names = hf_weight_names  # type: ignore[method-assign]


def _vocab_size(path: Path) -> int | None:
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{Path(path) / 'config.json'} cannot be read ({e})") from e
    for section in (config, config.get("text_config") or {}):
        if isinstance(section.get("vocab_size"), int):
            return section["vocab_size"]
    return None


def _tokenizer_vocab(path: Path) -> dict[str, int] | None:
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # the tokenizer loader reports a broken file with its own message
    vocab = dict((data.get("model") or {}).get("vocab") or {})
    for tok in data.get("added_tokens") or []:
        vocab[tok.get("content")] = tok.get("id")
    return vocab
