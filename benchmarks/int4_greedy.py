"""A packed INT4 engine against transformers on the dequantized weights, at a real shape (CPU,
fp32, random weights): the engine's projections are the quantizer's packed INT4, the
transformers model holds `dequantize(quantize(w, "int4"))` in the same projections and the
original weights elsewhere. Compared: greedy tokens from the same prompts, and the prompts'
logits (the engine's model forward after packing vs transformers'): the engine and transformers
on the dequantized weights differ only in float summation order, while the unquantized model's
logits show how far INT4 moves them. (Random weights make greedy decoding repeat tokens; the
logits are the sharper check.)

    PYTHONPATH=$PWD python benchmarks/int4_greedy.py --shape qwen3-0.6b --prompts 3 --tokens 16
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from milepost.bench import models as bench_models
from milepost.engine.request import Request
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.lowprec.contract import COVERED
from milepost.lowprec.quantize import dequantize, quantize


def engine_tokens(engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.submit(Request(rid=str(i), prompt_ids=p, stop_ids=frozenset(),
                              params=SamplingParams(max_new_tokens=tokens, temperature=0.0,
                                                    ignore_eos=True),
                              on_output=lambda o, i=i: got[i].extend(o.new_token_ids)))
    engine._drain_inbox(block=False)
    while engine.scheduler.has_work:
        engine.step()
    engine._flush()
    return [got[i] for i in range(len(prompts))]


def native_logits(model, seq: list[int]) -> torch.Tensor:
    from milepost.models.attention import VarlenCausalAttention
    from milepost.models.base import ForwardContext

    ctx = ForwardContext(attention=VarlenCausalAttention(torch.tensor([0, len(seq)])))
    with torch.no_grad():
        return model.compute_logits(model.forward(torch.tensor(seq), torch.arange(len(seq)), ctx))


def hf_logits(hf: torch.nn.Module, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0].float()


def hf_tokens(hf: torch.nn.Module, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), generation_config=cfg)[0, len(p):].tolist()
                for p in prompts]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--tokens", type=int, default=16)
    a = p.parse_args()
    torch.set_num_threads(2)
    t0 = time.time()
    cpu = torch.device("cpu")
    native, config_dir = bench_models.native_model(None, a.shape, torch.float32, cpu, 0)
    hf = bench_models.hf_copy(native, torch.float32, cpu)  # the original weights
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, native.vocab_size, (a.prompt_len,), generator=g).tolist()
               for _ in range(a.prompts)]
    plain = hf_tokens(hf, prompts, a.tokens)
    plain_logits = [hf_logits(hf, q) for q in prompts]
    quantized = 0
    with torch.no_grad():
        for name, w in hf.state_dict().items():
            if name.endswith(".weight") and name.split(".")[-2] in COVERED and w.dim() == 2:
                w.copy_(dequantize(quantize(w, "int4")))
                quantized += 1
    ref = hf_tokens(hf.eval(), prompts, a.tokens)
    ref_logits = [hf_logits(hf, q) for q in prompts]
    del hf
    args = ServerArgs(model_path=config_dir, device="cpu", dtype="float32", page_size=16,
                      max_total_tokens=4096, random_seed=0, quantization="int4").resolved()
    engine = build_engine(args, model=native)[0]
    qkv = engine.runner.model.model.layers[0].self_attn.qkv_proj
    got = engine_tokens(engine, prompts, a.tokens)
    eng_logits = [native_logits(engine.runner.model, q) for q in prompts]

    def maxdiff(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> float:
        return max((x - y).abs().max().item() for x, y in zip(xs, ys))

    out = {"shape": a.shape, "quantized_tensors": quantized,
           "engine_qkv_weight": [str(qkv.weight.dtype), list(qkv.weight.shape)],
           "equal": got == ref,
           "logits_max_abs_diff_engine_vs_dequantized": maxdiff(eng_logits, ref_logits),
           "logits_max_abs_diff_dequantized_vs_unquantized": maxdiff(ref_logits, plain_logits),
           "logits_max_abs": max(x.abs().max().item() for x in ref_logits),
           "argmax_equal_engine_vs_dequantized": all(
               torch.equal(x.argmax(-1), y.argmax(-1)) for x, y in zip(eng_logits, ref_logits)),
           "engine": got, "transformers_dequantized": ref,
           "transformers_unquantized": plain,
           "differs_from_unquantized": ref != plain, "seconds": round(time.time() - t0, 1),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
