"""Split FP8 GEMM outputs left unsummed (lowprec/fp8_act.SplitSum) on CUDA: an fp8_block engine
(decode in CUDA graphs, every projection's decode GEMM split in two) whose qkv projection (and,
switched on, o and down) hand their parts to the RoPE + store (fused add + norm) kernels decodes the same
greedy tokens and log-probs as with every sum its own launch.
Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_split_sum_cuda.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("to_norm", [False, True])
def test_engine_greedy_is_the_same_with_parts_left_unsummed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            to_norm: bool) -> None:
    """qkv_proj's parts go to the RoPE + store kernel; with fp8_act.PARTS_TO_NORM o_proj's and
    down_proj's to the fused add + norm too."""
    from milepost.engine.server_args import ServerArgs
    from milepost.kernels import fp8_decode, fp8_gemm
    from milepost.lowprec import fp8_act
    from milepost.lowprec.engine_store import QuantizedLinear
    from milepost.lowprec.fp8_act import SplitSum
    from milepost.testing.checkpoints import make_tiny_checkpoint
    from milepost.testing.engine_greedy import fresh_engine_greedy, random_prompts

    rule = fp8_decode.decode_config
    monkeypatch.setattr(fp8_decode, "decode_config", lambda *a: rule(*a)._replace(split=2, ticket=False))
    monkeypatch.setattr(fp8_gemm, "block_backend", lambda dev, m=None: "decode")
    monkeypatch.setattr(fp8_act, "PARTS_TO_NORM", to_norm)
    left: list[int] = []
    monkeypatch.setattr(fp8_decode, "SplitSum", lambda p, d: left.append(p.shape[2]) or SplitSum(p, d))
    ckpt = make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=3, with_tokenizer=False,
                                hidden_size=256, intermediate_size=512, head_dim=64,
                                num_attention_heads=4, num_key_value_heads=2)
    out, widths = {}, {}
    for leave in (False, True):
        monkeypatch.setattr(QuantizedLinear, "leave_split_parts", leave)
        left.clear()
        args = ServerArgs(model_path=ckpt, device="cuda", dtype="bfloat16", page_size=16,
                          max_total_tokens=4096, quantization="fp8_block").resolved()
        out[leave] = fresh_engine_greedy(args, random_prompts((37, 5, 130), seed=7), 16)
        widths[leave] = set(left)
    assert out[True] == out[False]
    # qkv_proj's parts (N = (4 + 2 + 2) x 64), o_proj's and down_proj's (N = hidden)
    assert widths == {False: set(), True: {512, 256} if to_norm else {512}}
