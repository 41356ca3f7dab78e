"""Export trained weights as a Hugging Face directory that `milepost serve` and transformers load.

Backend-agnostic: consumes `named_hf_weights()` (a collective every rank iterates) and has rank 0
write safetensors shards (+ index when more than one), config.json from the source directory with
its dtype updated, and every other non-weight file of the source (tokenizer, chat template,
generation config). Written into `<dir>.tmp-<pid>` and renamed, like checkpoints.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".safetensors.index.json", ".bin.index.json")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _copy_source_files(source: Path, out: Path, dtype: torch.dtype) -> None:
    config = json.loads((source / "config.json").read_text())
    # The trainer's weights are unquantized (an FP8 source is dequantized at load): the export
    # must not claim the source's FP8 layout.
    config.pop("quantization_config", None)
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    for key in keys:
        config[key] = _DTYPE_NAMES[dtype]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for f in source.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(f, out / f.name)


def write_hf_directory(
    named_weights: Iterable[tuple[str, torch.Tensor]],
    source_dir: str | Path,
    out_dir: str | Path,
    *,
    shard_bytes: int = 4 << 30,
) -> None:
    """Collective: every rank iterates `named_weights`; rank 0 writes `out_dir` atomically."""
    source, out = Path(source_dir), Path(out_dir).absolute()
    is_writer = not dist.is_initialized() or dist.get_rank() == 0
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    if is_writer:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    written: list[tuple[Path, list[str], int]] = []  # (file, names, bytes); shards go to disk as they fill
    shard: dict[str, torch.Tensor] = {}
    dtype = None

    def flush() -> None:
        f = tmp / f"part-{len(written):05d}.safetensors"
        save_file(shard, str(f), metadata={"format": "pt"})
        written.append((f, list(shard), sum(t.nbytes for t in shard.values())))
        shard.clear()

    for name, tensor in named_weights:
        if not is_writer:
            continue  # still iterate: the gather behind each tensor is a collective
        if not name.endswith(".input_scale"):  # float32 FP8 input scales (delayed scaling)
            dtype = tensor.dtype  # config.json's: the weights'
        if shard and sum(t.nbytes for t in shard.values()) + tensor.nbytes > shard_bytes:
            flush()
        shard[name] = tensor.detach().to("cpu", copy=True).contiguous()  # own storage: no shared views
    if is_writer:
        if dtype is None:
            raise ValueError("no weights to export")
        flush()
        _copy_source_files(source, tmp, dtype)
        n = len(written)
        weight_map = {}
        for i, (f, names, _) in enumerate(written):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            f.rename(tmp / final)
            weight_map.update({name: final for name in names})
        if n > 1:
            index = {"metadata": {"total_size": sum(b for _, _, b in written)}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    if dist.is_initialized():
        dist.barrier()
