"""`--decode-gemm` on CUDA: the stream-K GEMM (bf16) against F.linear at the Qwen3-4B projection
shapes, and an engine serving with it (stream, and auto's timing) decoding what the cuBLAS
engine decodes. Run on the accelerator machine:
`python -m pytest -q -m gpu tests/gpu/test_decode_gemm_cuda.py`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("n,k", [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)])
@pytest.mark.parametrize("m", [1, 13, 64, 256])
def test_stream_bf16_matches_f_linear(n: int, k: int, m: int) -> None:
    from milepost.kernels.stream_decode import stream_mm

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    ref = F.linear(x.float(), w.float())
    y = stream_mm(x, w, torch.float32)
    assert ((y - ref).abs() <= 1e-4 * ref.abs().amax(1, keepdim=True) + 1e-5).all()


@pytest.mark.parametrize("mode", ["stream", "auto"])
def test_engine_decodes_with_the_stream_gemm(tmp_path, mode: str) -> None:
    from milepost.engine.decode_gemm import StreamLinear
    from milepost.engine.server_args import ServerArgs
    from milepost.engine.setup import build_engine
    from milepost.testing.checkpoints import make_tiny_checkpoint
    from milepost.testing.engine_greedy import greedy_outputs, random_prompts

    ckpt = make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=3, with_tokenizer=False,
                                hidden_size=256, intermediate_size=512, head_dim=64,
                                num_attention_heads=4, num_key_value_heads=2)
    prompts = random_prompts((7, 3, 12), seed=1, high=500)
    out = {}
    for gemm in ("cublas", mode):
        args = ServerArgs(model_path=ckpt, device="cuda", dtype="bfloat16", decode_gemm=gemm,
                          max_total_tokens=4096).resolved()
        engine = build_engine(args)[0]
        try:
            streams = [m for m in engine.runner.model.modules() if isinstance(m, StreamLinear)]
            assert bool(streams) == (gemm == "stream") or gemm == "auto"
            out[gemm] = greedy_outputs(engine, prompts, 6)
        finally:
            engine.close()
            torch.cuda.empty_cache()
    toks, lps = out["cublas"]
    toks2, lps2 = out[mode]
    assert [len(t) for t in toks2] == [6, 6, 6]
    # bf16 sums in another order: close log-probs while the two decoded the same tokens (a near
    # tie may go the other way, and what follows is another continuation)
    for t, t2, a, b in zip(toks, toks2, lps, lps2):
        same = next((i for i, (u, v) in enumerate(zip(t, t2)) if u != v), len(t))
        assert all(abs(u - v) < 0.05 for u, v in zip(a[:same], b[:same])), (t, t2, a, b)
