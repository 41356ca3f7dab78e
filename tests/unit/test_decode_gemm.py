"""`--decode-gemm` (milepost/engine/decode_gemm.py): which projections become StreamLinear, their
forward at decode M (the stream-K kernel under Triton's interpreter, in fp16: the interpreter
multiplies bf16 tiles wrongly) and outside it (F.linear), and the settings it is refused with.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from milepost.engine.decode_gemm import BUCKETS, StreamLinear, convert_linears, use_stream_linears
from milepost.engine.server_args import ServerArgs
from milepost.testing.checkpoints import make_tiny_checkpoint


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({
        "qkv": nn.Linear(128, 192, bias=False, dtype=torch.float16),
        "o": nn.Linear(128, 128, bias=True, dtype=torch.float16),
        "o2": nn.Linear(128, 128, bias=False, dtype=torch.float16),
        "odd": nn.Linear(128, 100, bias=False, dtype=torch.float16),  # N not whole 64-row tiles
        "fp32": nn.Linear(128, 128, bias=False),  # not 16-bit
        "emb": nn.Embedding(10, 128),
    })


def test_plain_16_bit_linears_of_whole_tiles_are_converted_by_shape() -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    groups = []
    chosen = convert_linears(model, lambda mods: groups.append(len(mods)) or {1, 64})
    assert chosen == {(192, 128): [1, 64], (128, 128): [1, 64]}
    assert sorted(groups) == [1, 2]  # o and o2 share a shape: timed together
    assert {n for n, m in model.items() if isinstance(m, StreamLinear)} == {"qkv", "o", "o2"}
    assert model["o"].stream_buckets == frozenset({1, 64})
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    untouched = _model()
    assert convert_linears(untouched, lambda mods: set()) == {}
    assert not any(isinstance(m, StreamLinear) for m in untouched.modules())


def test_cublas_or_cpu_leaves_the_model_as_it_is() -> None:
    model = _model()
    assert use_stream_linears(model, "cublas", torch.device("cpu")) == {}
    assert use_stream_linears(model, "stream", torch.device("cpu")) == {}
    assert not any(isinstance(m, StreamLinear) for m in model.modules())


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_forward_runs_the_kernel_at_decode_m_and_f_linear_otherwise(monkeypatch: pytest.MonkeyPatch,
                                                                     rows: int) -> None:
    """In the interpreter on CPU (StreamLinear.devices), the bias added after; 300 rows (past
    DECODE_M), a training forward (grad on) and the buckets not chosen take F.linear."""
    from milepost.kernels import stream_decode

    model = _model()
    convert_linears(model, lambda mods: set(BUCKETS) - {16})
    monkeypatch.setattr(StreamLinear, "devices", ("cuda", "cpu"))
    calls = {"n": 0}
    real = stream_decode.stream_mm

    def counted(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(stream_decode, "stream_mm", counted)
    x = torch.randn(rows, 128).to(torch.float16)
    lin = model["o"]
    with torch.inference_mode():
        y = lin(x.reshape(1, rows, 128))
    ref = (x.float() @ lin.weight.float().t() + lin.bias.float()).reshape(1, rows, 128)
    assert y.shape == (1, rows, 128) and y.dtype == torch.float16
    assert (y.float() - ref).abs().max() < 2e-2 * ref.abs().max()
    assert calls["n"] == (1 if rows <= 256 else 0)
    with torch.inference_mode():
        lin(torch.randn(12, 128).to(torch.float16))  # bucket 16: not chosen
    lin.weight.requires_grad_(True)
    lin(torch.randn(2, 128).to(torch.float16))  # grad on: a training forward
    assert calls["n"] == (1 if rows <= 256 else 0)


def test_stream_is_refused_and_auto_keeps_cublas_with_quantization_adapters_or_true_on_policy(tmp_path) -> None:
    from milepost.engine.decode_gemm import applies

    ckpt = make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=0, with_tokenizer=False)
    assert applies(ServerArgs(model_path=ckpt, decode_gemm="stream"))
    assert applies(ServerArgs(model_path=ckpt, decode_gemm="auto"))
    assert not applies(ServerArgs(model_path=ckpt))
    for extra in ({"quantization": "fp8_block"}, {"enable_lora": True}, {"true_on_policy": True}):
        with pytest.raises(ValueError, match="--decode-gemm stream runs the 16-bit projections"):
            ServerArgs(model_path=ckpt, decode_gemm="stream", **extra)
        assert not applies(ServerArgs(model_path=ckpt, decode_gemm="auto", **extra))
