"""A tiny random Stable Diffusion 3 pipeline built locally (nothing downloaded), for CPU tests.

Every part is the real `diffusers` / `transformers` class at a tiny size: an SD3Transformer2DModel,
an AutoencoderKL (16 latent channels, as SD3's), two CLIPTextModelWithProjection and a
T5EncoderModel with word-level tokenizers, and a FlowMatchEulerDiscreteScheduler. Saved with
`save_pretrained`, so the directory is what a user's SD3 checkout looks like (plus prompts.txt).
`python -m milepost.diffusion.hf_tiny DIR`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

WORDS = ["a", "red", "green", "blue", "circle", "square", "triangle", "bright", "dark", "photo", "of"]
PROMPTS = ["a red circle", "a green square", "a blue triangle"]


def _tokenizer(max_length: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", model_max_length=max_length)


def build_tiny_sd3(path: str | Path, *, seed: int = 0, sample_size: int = 8, width: int = 32,
                   layers: int = 2) -> Path:
    """Write a tiny random SD3 pipeline (latents [16, sample_size, sample_size], images 8x larger;
    transformer width `width` = T5 width, heads of 8)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        T5Config,
        T5EncoderModel,
    )

    path = Path(path)
    torch.manual_seed(seed)
    vocab = len(WORDS) + 4
    clip = {"vocab_size": vocab, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "max_position_embeddings": 77, "projection_dim": 16, "pad_token_id": 0,
            "bos_token_id": 2, "eos_token_id": 3}
    t5 = T5Config(vocab_size=vocab, d_model=width, d_kv=8, d_ff=64, num_layers=2, num_heads=4, pad_token_id=0,
                  eos_token_id=3, decoder_start_token_id=0)
    transformer = SD3Transformer2DModel(
        sample_size=sample_size, patch_size=2, in_channels=16, num_layers=layers, attention_head_dim=8,
        num_attention_heads=width // 8, joint_attention_dim=width, caption_projection_dim=width, pooled_projection_dim=32,
        out_channels=16, pos_embed_max_size=sample_size)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8, 8, 8, 8),
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        layers_per_block=1, norm_num_groups=4, sample_size=sample_size * 8,
                        scaling_factor=1.5305, shift_factor=0.0609)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0), vae=vae,
        text_encoder=CLIPTextModelWithProjection(CLIPTextConfig(**clip)), tokenizer=_tokenizer(77),
        text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(**clip)), tokenizer_2=_tokenizer(77),
        text_encoder_3=T5EncoderModel(t5), tokenizer_3=_tokenizer(16))
    pipe.save_pretrained(str(path))
    (path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m milepost.diffusion.hf_tiny", description=__doc__)
    ap.add_argument("path")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(build_tiny_sd3(args.path, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
