"""Decode speed with and without the sampler's features: penalties, logit_bias, grammars (issue 17).

One engine in-process (no HTTP), random weights of a real shape, one workload per variant
(requests x prompt -> new tokens, temperature 1, ignore_eos): `plain` (no feature), `penalties`
(frequency + presence + repetition on every request), `bias` (16 biased ids on every request),
`json` (a JSON-schema grammar on every request, one that cannot complete within the output
length, so every request decodes to the end), `json-half` (the grammar on every other request:
a mixed batch). `plain` runs first and last, to bound drift within the process; warm-ups of
`plain` (and `json`: its first masks build the grammar's lexer states) run before. Only `plain`
uses nothing new, so the script also runs on trees from before these features (a folder holding
an old `milepost/` first on PYTHONPATH): old `plain` vs HEAD `plain` is the cost when unused.

    python benchmarks/sampler_features.py --shape qwen3-0.6b --tokenizer DIR --json-out out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

from milepost.bench.models import native_model
from milepost.engine.request import Request
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine

# A list of at least 100 records: at >= 4 tokens a record it cannot end inside 256 new tokens.
SCHEMA = {"type": "array", "minItems": 100, "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"]}}
FEATURES = {
    "plain": {},
    "penalties": {"frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.1},
    "bias": {"logit_bias": {}},  # filled in run(): 16 ids spread over the vocabulary
    "json": {"json_schema": json.dumps(SCHEMA)},
    "json-half": {"json_schema": json.dumps(SCHEMA)},
}


def run(engine: object, vocab: int, compiler: object | None, variant: str,
        args: argparse.Namespace, seed: int) -> dict:
    """One workload through the engine; end-to-end and decode-step figures."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(100, min(vocab, 100_000), (args.requests, args.prompt_len),
                            generator=gen).tolist()
    extra = FEATURES[variant]
    if variant == "bias":
        extra = {"logit_bias": {str((1000 + 7919 * i) % vocab): 2.0 for i in range(16)}}
    grammar_field = "json_schema" if "json_schema" in extra else None
    done = threading.Event()
    left = [args.requests]
    tokens = [0]
    lock = threading.Lock()

    def on_output(out: object) -> None:
        with lock:
            tokens[0] += len(out.new_token_ids)
            if out.finished:
                if (out.finish_reason or {}).get("type") != "length":
                    print(f"  {variant}: a request ended early: {out.finish_reason}", flush=True)
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    reqs = []
    for i, ids in enumerate(prompts):
        use = extra if variant != "json-half" or i % 2 == 0 else {}
        params = SamplingParams(max_new_tokens=args.output_len, temperature=1.0, ignore_eos=True,
                                **use)
        kw = {}
        if grammar_field and use:
            kw["grammar"] = compiler.compile_now(grammar_field, use[grammar_field])[0]
        reqs.append(Request(rid=f"{variant}-{seed}-{i}", prompt_ids=ids, params=params,
                            on_output=on_output, stop_ids=frozenset(), **kw))
    assert engine.call(engine.flush_cache).result()
    s = engine.stats
    steps0, secs0 = s.decode_steps, s.decode_seconds
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    t0 = time.perf_counter()
    for r in reqs:
        engine.submit(r)
    done.wait()
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    seconds = time.perf_counter() - t0
    steps, secs = s.decode_steps - steps0, s.decode_seconds - secs0
    row = {"variant": variant, "seconds": seconds, "output_tokens": tokens[0],
           "tok_s": tokens[0] / seconds, "decode_steps": steps,
           "decode_step_ms": 1000 * secs / max(steps, 1)}
    print(f"  {variant}: {row['tok_s']:,.0f} tok/s, decode step {row['decode_step_ms']:.2f} ms "
          f"({steps} steps), {seconds:.2f} s", flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--tokenizer", type=Path, help="HF tokenizer dir matching the shape's vocab "
                   "(needed by the json variants)")
    p.add_argument("--variants", default="plain,penalties,bias,json,json-half,plain")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--label", default="head", help="names this tree in the output")
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    import milepost

    print(f"{args.label}: milepost from {Path(milepost.__file__).parent}", flush=True)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    native, config_dir = native_model(None, args.shape, dtype, device, 0)
    sargs = ServerArgs(model_path=config_dir, device=device.type,
                       dtype=str(dtype).removeprefix("torch."), max_running_requests=args.requests,
                       chunked_prefill_size=16384 if cuda else None,
                       max_total_tokens=None if cuda else args.requests * (args.prompt_len
                                                                           + args.output_len + 32),
                       random_seed=0).resolved()
    engine, info, _ = build_engine(sargs, model=native)
    engine.start()
    variants = args.variants.split(",")
    compiler = None
    if any(v.startswith("json") for v in variants):
        from transformers import AutoTokenizer

        from milepost.engine.grammar import GrammarCompiler

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        compiler = GrammarCompiler(tok, info.vocab_size, info.eos_token_ids or [tok.eos_token_id])
        t0 = time.perf_counter()
        compiler.compile_now("json_schema", FEATURES["json"]["json_schema"])
        print(f"  grammar vocabulary + first compile: {time.perf_counter() - t0:.2f} s")
    rows = []
    try:
        print(f"{args.label}: warm-up", flush=True)
        run(engine, info.vocab_size, compiler, "plain", args, seed=999)
        if compiler is not None:  # the grammar's first masks build its lexer states: once
            run(engine, info.vocab_size, compiler, "json", args, seed=998)
        for k, v in enumerate(variants):
            rows.append(run(engine, info.vocab_size, compiler, v, args, seed=k))
    finally:
        engine.close()
    result = {"label": args.label, "shape": args.shape, "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if cuda else "cpu", "rows": rows,
              "requests": args.requests, "prompt_len": args.prompt_len,
              "output_len": args.output_len}
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
