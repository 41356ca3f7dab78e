"""`milepost convert`: the command's flags; the work is in milepost/convert.py (imported when run,
so `milepost --help` does not load torch)."""

from __future__ import annotations

import argparse


def add_convert_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert", help="convert checkpoints between Hugging Face and Megatron-core (docs/megatron.md)",
        description="Bit-exact conversion between a Hugging Face directory and a Megatron checkpoint "
        "cut for tensor / pipeline / expert parallel sizes (Llama, Qwen3, Qwen3-MoE).")
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
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
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
