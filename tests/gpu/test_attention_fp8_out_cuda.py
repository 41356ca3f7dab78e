"""o_proj's input quantized by the decode attention kernel (TritonPagedAttention.quantize_out,
kernels/paged_attention.py `fp8_out`) on CUDA: an fp8_block engine (decode in CUDA graphs, bf16
and fp8 KV pools) decodes the same greedy tokens and log-probs with it on as off, and on, the
decode steps' o_proj inputs come from the attention kernel.
Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_attention_fp8_out_cuda.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_engine_greedy_is_the_same_with_the_attention_quantizing(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 kv: str) -> None:
    from milepost.engine.server_args import ServerArgs
    from milepost.kernels import paged_attention
    from milepost.lowprec.fp8_act import Fp8Act
    from milepost.models.triton_attention import TritonPagedAttention
    from milepost.testing.checkpoints import make_tiny_checkpoint
    from milepost.testing.engine_greedy import fresh_engine_greedy, random_prompts

    made: list[int] = []
    decode = paged_attention.paged_decode

    def counted(*a, **kw):
        out = decode(*a, **kw)
        made.append(isinstance(out, Fp8Act))
        return out

    monkeypatch.setattr(paged_attention, "paged_decode", counted)
    ckpt = make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=3, with_tokenizer=False,
                                hidden_size=256, intermediate_size=512, head_dim=128,
                                num_attention_heads=4, num_key_value_heads=2)
    out, quantized = {}, {}
    for on in (False, True):
        monkeypatch.setattr(TritonPagedAttention, "quantize_out", on)
        made.clear()
        args = ServerArgs(model_path=ckpt, device="cuda", dtype="bfloat16", page_size=16,
                          max_total_tokens=4096, quantization="fp8_block",
                          kv_cache_dtype=kv).resolved()
        out[on] = fresh_engine_greedy(args, random_prompts((37, 5, 130, 9), seed=7), 16)
        quantized[on] = sum(made)
    assert out[True] == out[False]
    assert quantized[False] == 0 and quantized[True] > 0
