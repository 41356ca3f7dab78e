"""Device memory of a quantized engine start from a bf16 checkpoint (issue 23): loaded, fused and
quantized layer by layer, the start's peak (torch.cuda.max_memory_allocated) is the FP8 model plus
its KV pool plus about one layer in bf16, where quantizing after the whole bf16 build peaks above
the bf16 model; under a memory cap between the two only the layerwise start fits. Qwen3 shape of a
few hundred MB (24 layers of Qwen3-0.6B's, vocabulary 32768), random bf16 weights. Run on the
accelerator machine: `python -m pytest -q -s -m gpu tests/gpu/test_lowprec_layerwise_load_cuda.py`.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
import transformers

from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.lowprec.engine_load import held_bytes
from milepost.models.registry import load_model
from milepost.testing.random_checkpoint import write_random_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
_MIB = 2**20
SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=24, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, vocab_size=32768, tie_word_embeddings=True,
             rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=4096)
# One decoder layer's weights in bf16: q, k, v, o, gate, up, down and two norms.
LAYER = 2 * (1024 * (2048 + 1024 + 1024) + 2048 * 1024 + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = transformers.Qwen3Config(**SHAPE)
    config.architectures = ["Qwen3ForCausalLM"]
    return write_random_checkpoint(tmp_path_factory.mktemp("layerwise_cuda") / "bf16", config)


def _start(path: Path, fmt: str | None, after_build: bool = False) -> dict[str, int]:
    """One engine start: its peak device bytes over what was allocated before, its weights, its KV."""
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    args = ServerArgs(model_path=path, device="cuda", dtype="bfloat16", max_total_tokens=256,
                      page_size=16, disable_cuda_graph=True, quantization=fmt).resolved()
    model = load_model(path, torch.bfloat16, torch.device("cuda")) if after_build else None
    engine = build_engine(args, model=model)[0]
    out = {"peak": torch.cuda.max_memory_allocated() - base, "weights": held_bytes(engine.runner.model),
           "kv": engine.runner.kv.nbytes()}
    del engine, model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def test_fp8_start_peaks_at_the_fp8_model_plus_one_bf16_layer(ckpt: Path) -> None:
    _start(ckpt, "fp8_block", after_build=True)  # the GEMM probe's one-time buffers, unmeasured
    after = _start(ckpt, "fp8_block", after_build=True)
    bf16 = _start(ckpt, None)
    fp8 = _start(ckpt, "fp8_block")
    print(json.dumps({k: {m: round(v / _MIB, 1) for m, v in r.items()} for k, r in
                      (("bf16", bf16), ("fp8_block layerwise", fp8), ("fp8_block after-build", after))}
                     | {"layer_bf16_mib": round(LAYER / _MIB, 1)}))
    assert fp8["weights"] == after["weights"] and fp8["weights"] < 0.65 * bf16["weights"]
    assert after["peak"] >= bf16["weights"]  # the whole bf16 model was held before quantizing
    # One bf16 layer, its fused copy, the quantizer's float32 temporaries: a few layers' bytes.
    assert fp8["peak"] <= fp8["weights"] + fp8["kv"] + 3 * LAYER + 64 * _MIB
    assert fp8["peak"] < 0.8 * after["peak"]


def test_under_a_cap_between_the_two_peaks_only_the_layerwise_start_fits(ckpt: Path) -> None:
    fp8, bf16 = _start(ckpt, "fp8_block"), _start(ckpt, None)
    assert fp8["peak"] < 0.8 * bf16["weights"]  # room for a cap between them
    cap = (fp8["peak"] + bf16["weights"]) // 2  # quantize-after-build holds the bf16 model first
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + cap) / total)
    try:
        try:
            _start(ckpt, "fp8_block", after_build=True)
            fitted = True
        except (torch.OutOfMemoryError, RuntimeError):  # not bound: its frames (and tensors) go now
            fitted = False
        gc.collect()
        torch.cuda.empty_cache()
        assert not fitted, "quantize-after-build fitted under the cap: the cap proves nothing"
        assert _start(ckpt, "fp8_block")["weights"] == fp8["weights"]
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
