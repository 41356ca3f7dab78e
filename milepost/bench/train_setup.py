"""Settings, model shapes and model FLOPs of `milepost bench train` (argparse: runs without pydantic).

`--shape` writes a random-weight checkpoint of a real architecture (bf16 safetensors, built on the
device from milepost's native definition, so nothing is downloaded) to a temporary directory;
`--layers` keeps only the first N decoder layers of a shape (for shapes that do not fit whole).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

# Dense bf16 peak of known devices (FLOP/s), matched on the device name; MFU is reported against it.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}
SHAPE_NAMES = ("qwen3-0.6b", "qwen3-4b", "qwen3-30b-a3b", "tiny")


@dataclass(frozen=True)
class TrainBenchArgs:
    model: Path | None
    shape: str | None
    layers: int | None
    samples: int
    prompt: int
    response: int
    steps: int
    micro_batch_tokens: int
    activation_checkpointing: str
    compile_layers: bool
    hf: bool
    hf_micro_batch: int | None
    device: str
    peak_tflops: float | None
    seed: int
    json_out: Path | None
    fused_kernels: bool = True
    backend: str = "fsdp"  # fsdp | megatron | both (docs/megatron.md)
    precision: str = "bf16"  # milepost's trainer format (docs/low_precision.md)
    fp8_scaling: str = "current"  # fp8_block: per-block (current) or per-tensor delayed scales

    @property
    def seq_len(self) -> int:
        return self.prompt + self.response


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="milepost bench train",
        description="milepost's trainer step vs a plain Hugging Face training loop on the same model "
        "and batch, in one run: tokens/s, MFU, peak memory, ratio. CPU example: "
        "milepost bench train --shape tiny --samples 4 --prompt 16 --response 16 --steps 1")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="Hugging Face model directory to train.")
    src.add_argument("--shape", choices=SHAPE_NAMES,
                     help="a real architecture shape with random weights (tiny: a CPU-sized Qwen3)")
    p.add_argument("--layers", type=int, help="--shape only: keep the first N decoder layers")
    p.add_argument("--samples", type=int, default=16, help="samples per step (one optimizer step)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens per sample")
    p.add_argument("--response", type=int, default=512, help="response (trained) tokens per sample")
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step (median)")
    p.add_argument("--micro-batch-tokens", type=int, default=16384,
                   help="milepost's max_tokens_per_micro_batch; the HF loop uses as many samples per "
                   "micro-batch as fit in it")
    p.add_argument("--activation-checkpointing", choices=("none", "layer"), default="none",
                   help="milepost's activation checkpointing (the HF loop always checkpoints)")
    p.add_argument("--compile-layers", action="store_true",
                   help="milepost: torch.compile each decoder layer (TrainerSettings.compile_layers)")
    p.add_argument("--fused-kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="milepost: the fused Triton training kernels on CUDA (TrainerSettings.fused_kernels)")
    p.add_argument("--backend", choices=("fsdp", "megatron", "both"), default="fsdp",
                   help="milepost's training backend; both = FSDP then Megatron-core in the same run "
                   "(TP = PP = EP = 1; pip install 'milepost[megatron]')")
    p.add_argument("--precision", choices=("bf16", "fp8_block", "mxfp8", "nvfp4", "int4"),
                   default="bf16", help="milepost's trainer format (TrainerSettings.precision; "
                   "docs/low_precision.md); the HF loop stays unquantized")
    p.add_argument("--fp8-scaling", choices=("current", "delayed"), default="current",
                   help="--precision fp8_block: activation and gradient scales per 1 x 128 block "
                   "(current) or per tensor from the amax history (delayed; TrainerSettings.fp8_scaling). "
                   "The warm-up step has no history yet; the timed steps run the per-tensor GEMMs")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the Hugging Face loop and print the ratio")
    p.add_argument("--hf-micro-batch", type=int, help="samples per HF micro-batch (default: by tokens)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--peak-tflops", type=float,
                   help="device peak for MFU in TFLOP/s (default: H200/H100 989, A100 312; none on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", type=Path, help="also write the results as JSON here")
    return p


def parse_args(argv: list[str] | None) -> TrainBenchArgs:
    parser = build_parser()
    ns = parser.parse_args(argv)
    for flag in ("samples", "prompt", "response", "steps", "micro_batch_tokens", "layers", "hf_micro_batch"):
        value = getattr(ns, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1; got {value}")
    if ns.compile_layers and ns.activation_checkpointing != "none":
        parser.error("--compile-layers with --activation-checkpointing layer is not supported yet: choose one")
    if ns.fp8_scaling == "delayed" and ns.precision != "fp8_block":
        parser.error(f"--fp8-scaling delayed needs --precision fp8_block; got --precision {ns.precision}")
    if ns.fp8_scaling == "delayed" and ns.backend != "fsdp":
        parser.error("--fp8-scaling delayed runs on the FSDP backend only; use --backend fsdp")
    if ns.layers is not None and ns.shape is None:
        parser.error("--layers applies to --shape only (a --model directory is trained whole)")
    if ns.model is not None and not (ns.model / "config.json").is_file():
        parser.error(f"--model {ns.model} has no config.json; pass a Hugging Face directory")
    device = ns.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here; use --device cpu")
    return TrainBenchArgs(ns.model, ns.shape, ns.layers, ns.samples, ns.prompt, ns.response, ns.steps,
                          ns.micro_batch_tokens, ns.activation_checkpointing, ns.compile_layers, ns.hf, ns.hf_micro_batch,
                          device, ns.peak_tflops, ns.seed, ns.json_out, ns.fused_kernels, ns.backend,
                          ns.precision, ns.fp8_scaling)


def shape_config(shape: str, layers: int | None):
    """The transformers config of one of the engine bench's shapes, `layers` deep if given."""
    import transformers

    from milepost.bench.models import SHAPES

    config_cls, arch, kwargs = SHAPES[shape]
    if layers is not None:
        kwargs = dict(kwargs, num_hidden_layers=layers)
    config = getattr(transformers, config_cls)(**kwargs)
    config.architectures = [arch]
    return config


def write_shape_checkpoint(shape: str, layers: int | None, device: str, seed: int) -> Path:
    """Random weights of `shape` (N(0, 0.02), norms 1) saved as a Hugging Face directory."""
    from safetensors.torch import save_file

    from milepost.models.registry import build_model

    config = shape_config(shape, layers)
    path = Path(tempfile.mkdtemp(prefix=f"milepost-bench-train-{shape}-"))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(config, dtype, torch.device(device))
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, 0.02, generator=gen)
        tensors = {n: model.weight_view(n).to("cpu").contiguous() for n in model.hf_weight_names()}
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    return path


def train_flops(config: object, samples: int, prompt: int, response: int) -> float:
    """Model FLOPs of one training step (forward + backward = 3x forward; no recompute counted).

    Matmul weights count 6 per weight per token (MoE: the top-k experts a token uses), the LM head
    only on the scored (response) rows, causal attention 6 * L^2 * heads * head_dim per sequence
    and layer (QK^T and PV, half the square each).
    """
    h = config.hidden_size
    heads = config.num_attention_heads
    kv = config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // heads
    attn = h * heads * d * 2 + 2 * h * kv * d
    experts = getattr(config, "num_experts", 0) or 0
    sparse = set() if not experts else {
        i for i in range(config.num_hidden_layers)
        if i not in (getattr(config, "mlp_only_layers", []) or [])
        and (i + 1) % getattr(config, "decoder_sparse_step", 1) == 0}
    weights = 0
    for i in range(config.num_hidden_layers):
        if i in sparse:
            weights += attn + config.num_experts_per_tok * 3 * h * config.moe_intermediate_size + h * experts
        else:
            weights += attn + 3 * h * config.intermediate_size
    seq = prompt + response
    tokens = samples * seq
    dense = 6.0 * weights * tokens + 6.0 * h * config.vocab_size * samples * response
    attention = 6.0 * config.num_hidden_layers * samples * seq * seq * heads * d
    return dense + attention


def device_peak(args: TrainBenchArgs) -> float | None:
    if args.peak_tflops is not None:
        return args.peak_tflops * 1e12
    if args.device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)
