"""`milepost convert`: the command's flags; the work is in milepost/convert.py (imported when run,
so `milepost --help` does not load torch)."""

from __future__ import annotations

import argparse


def add_convert_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert", help="convert checkpoints between Hugging Face and Megatron-core (docs/megatron.md), "
        "or to FP8 blockwise / INT4 W4A16 (docs/low_precision.md)",
        description="Bit-exact conversion between a Hugging Face directory and a Megatron checkpoint "
        "cut for tensor / pipeline / expert parallel sizes (Llama, Qwen3, Qwen3-MoE); hf-to-fp8 "
        "writes an FP8 blockwise checkpoint, hf-to-int4 an INT4 W4A16 one (compressed-tensors).")
    kinds = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    to_meg = kinds.add_parser("hf-to-megatron", help="Hugging Face directory -> Megatron checkpoint")
    to_meg.add_argument("source", help="Hugging Face model directory (config.json + safetensors)")
    to_meg.add_argument("dest", help="Megatron checkpoint directory to write")
    to_meg.add_argument("--tensor-model-parallel-size", type=int, default=1)
    to_meg.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    to_meg.add_argument("--expert-model-parallel-size", type=int, default=1)
    to_hf = kinds.add_parser("megatron-to-hf", help="Megatron checkpoint -> Hugging Face directory")
    to_hf.add_argument("source", help="Megatron checkpoint directory (written by hf-to-megatron)")
    to_hf.add_argument("dest", help="Hugging Face directory to write")
    to_fp8 = kinds.add_parser(
        "hf-to-fp8", help="Hugging Face directory -> FP8 blockwise checkpoint (docs/low_precision.md)",
        description="The projection linears in FP8 128 x 128 blockwise (weight + weight_scale_inv, "
        "DeepSeek-V3 / SGLang layout), quantized by the quantizer the trainer and engines use; "
        "`milepost serve --model-path DEST` serves it as stored.")
    to_int4 = kinds.add_parser(
        "hf-to-int4", help="Hugging Face directory -> INT4 W4A16 checkpoint (docs/low_precision.md)",
        description="The projection linears in symmetric INT4, one float32 scale per 128 values of "
        "a row (compressed-tensors pack-quantized: weight_packed + weight_scale + weight_shape), "
        "quantized by the quantizer the trainer and engines use; `milepost serve --model-path "
        "DEST` serves it as stored.")
    for sub in (to_fp8, to_int4):
        sub.add_argument("source", help="Hugging Face model directory (config.json + safetensors)")
        sub.add_argument("dest", help="directory to write")
        sub.add_argument("--precision-override", action="append", default=[],
                         help="PATTERN=bf16: keep these tensors unquantized (glob or layers.A-B)")
        sub.add_argument("--precision-bf16-first-layers", type=int, default=0)
        sub.add_argument("--precision-bf16-last-layers", type=int, default=0)
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    if ns.direction in ("hf-to-fp8", "hf-to-int4"):  # the lowprec converter's own command line
        from milepost.lowprec.convert import main as lowprec_main

        argv = [ns.source, ns.dest, "--precision-bf16-first-layers", str(ns.precision_bf16_first_layers),
                "--precision-bf16-last-layers", str(ns.precision_bf16_last_layers),
                "--format", "int4" if ns.direction == "hf-to-int4" else "fp8_block"]
        try:
            lowprec_main(argv + [f"--precision-override={o}" for o in ns.precision_override])
        except ValueError as err:
            print(f"milepost convert: {err}")
            return 2
        return 0
    from milepost.convert import hf_to_megatron_dir, megatron_to_hf_dir
    from milepost.train.megatron.parallel import ParallelSizes

    try:
        if ns.direction == "hf-to-megatron":
            sizes = ParallelSizes(tp=ns.tensor_model_parallel_size, pp=ns.pipeline_model_parallel_size,
                                  ep=ns.expert_model_parallel_size)
            files = hf_to_megatron_dir(ns.source, ns.dest, sizes)
            print(f"wrote {len(files)} Megatron rank files (tp={sizes.tp}, pp={sizes.pp}, ep={sizes.ep}) to {ns.dest}")
        else:
            megatron_to_hf_dir(ns.source, ns.dest)
            print(f"wrote a Hugging Face directory to {ns.dest}")
    except (ValueError, KeyError, FileNotFoundError) as err:
        print(f"milepost convert: {err}")
        return 2
    return 0
