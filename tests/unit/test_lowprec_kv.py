"""The FP8 KV cache (`--kv-cache-dtype fp8_e4m3`): entries saturate at +-448, the paged attention
over an fp8 pool matches attention over the pool's dequantized values exactly, and an engine
with it holds 4x the tokens of fp32 (2x bf16) in the same bytes and generates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milepost.engine.request import Request
from milepost.engine.sampling_params import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.models.attention import (
    PagedBatch,
    PagedKVCache,
    TorchPagedAttention,
    to_cache,
)
from milepost.testing.checkpoints import make_tiny_checkpoint

torch.set_num_threads(1)
FP8 = torch.float8_e4m3fn


def test_entries_saturate_and_round_to_e4m3() -> None:
    x = torch.tensor([1000.0, -1e6, 0.3, 448.0])
    assert to_cache(x, FP8).float().tolist() == [448.0, -448.0, 0.3125, 448.0]


def test_attention_over_an_fp8_pool_is_attention_over_its_values() -> None:
    gen = torch.Generator().manual_seed(0)
    batch = PagedBatch.build([5, 1], [5, 9], [[0, 1], [2, 3, 4]], 4)
    q = torch.randn(6, 4, 16, generator=gen)
    k, v = torch.randn(6, 2, 16, generator=gen), torch.randn(6, 2, 16, generator=gen)
    outs = {}
    for dtype in (FP8, torch.float32):
        cache = PagedKVCache(1, 5, 4, 2, 16, dtype, "cpu")
        prior = torch.randn(20, 2, 16, generator=torch.Generator().manual_seed(1))
        cache.k[0][:] = to_cache(prior, dtype)
        cache.v[0][:] = to_cache(prior * 0.5, dtype)
        attn = TorchPagedAttention(cache)
        attn.prepare(batch)
        # the float pool gets the values the fp8 pool holds: rounding is the only difference
        kk, vv = (k, v) if dtype == FP8 else (to_cache(k, FP8).float(), to_cache(v, FP8).float())
        if dtype != FP8:
            cache.k[0][:] = to_cache(prior, FP8).float()
            cache.v[0][:] = to_cache(prior * 0.5, FP8).float()
        outs[dtype] = attn.attend(0, q, kk, vv, 0.25)
    assert torch.equal(outs[FP8], outs[torch.float32])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("kv") / "m", "qwen3", seed=4,
                                with_tokenizer=False)


def test_engine_with_an_fp8_pool_fits_more_tokens_and_generates(ckpt: Path) -> None:
    pools = {}
    for kv in ("float32", "fp8_e4m3"):
        args = ServerArgs(model_path=ckpt, device="cpu", dtype="float32", page_size=4,
                          kv_cache_dtype=kv, cpu_kv_cache_gb=0.001).resolved()
        engine = build_engine(args)[0]
        pools[kv] = engine.runner.kv.num_blocks
        got: list[int] = []
        engine.submit(Request(rid="a", prompt_ids=[5, 6, 7, 8, 9], stop_ids=frozenset(),
                              params=SamplingParams(max_new_tokens=6, temperature=0.0,
                                                    ignore_eos=True),
                              on_output=lambda o, got=got: got.extend(o.new_token_ids)))
        engine._drain_inbox(block=False)
        while engine.scheduler.has_work:
            engine.step()
        engine._flush()
        assert len(got) == 6
        engine.close()
    # the same bytes: a quarter of the entry size, four times the blocks (up to flooring)
    assert 4 * pools["float32"] <= pools["fp8_e4m3"] <= 4 * pools["float32"] + 4
