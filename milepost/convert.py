"""`milepost convert hf-to-megatron|megatron-to-hf`: checkpoints between Hugging Face and Megatron.

The Megatron side is Megatron-LM's legacy layout: `<dir>/latest_checkpointed_iteration.txt` says
"release", and `<dir>/release/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt` holds {"model": state dict}
for each (tensor, pipeline, expert) rank. The HF config and tokenizer files are kept beside it in
`<dir>/hf/` so megatron-to-hf writes a complete Hugging Face directory. Needs no megatron-core.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from milepost.train.export import write_hf_directory
from milepost.train.megatron.convert import (
    hf_to_megatron,
    megatron_to_hf,
    shard,
    unshard,
)
from milepost.train.megatron.parallel import ParallelSizes, validate_sizes
from milepost.train.megatron.provider import read_hf_weights
from milepost.train.megatron.shape import shape_of

LAYOUT_FILE = "milepost_megatron.json"


def rank_dir(root: Path, tp_rank: int, pp_rank: int, ep_rank: int, sizes: ParallelSizes) -> Path:
    """Megatron-LM's checkpoint directory name of one (tensor, pipeline, expert) rank."""
    name = f"mp_rank_{tp_rank:02d}"
    if sizes.pp > 1:
        name += f"_{pp_rank:03d}"
    if sizes.ep > 1:
        name += f"_{ep_rank:03d}"
    return root / "release" / name


def hf_to_megatron_dir(hf_dir: str | Path, out_dir: str | Path, sizes: ParallelSizes) -> list[Path]:
    """Write the Megatron checkpoint of `hf_dir` cut for `sizes`; returns the rank files written."""
    hf_dir, out = Path(hf_dir), Path(out_dir)
    shape = shape_of(json.loads((hf_dir / "config.json").read_text()))
    # Offline: the ranks are exactly the model-parallel ones (data parallel copies share them).
    validate_sizes(shape, sizes, sizes.tp * sizes.pp * sizes.ep)
    full = hf_to_megatron(shape, read_hf_weights(hf_dir))
    written = []
    for pp_rank in range(sizes.pp):
        for ep_rank in range(sizes.ep):
            for tp_rank in range(sizes.tp):
                piece = shard(shape, full, tp=sizes.tp, pp=sizes.pp, ep=sizes.ep,
                              tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=ep_rank)
                d = rank_dir(out, tp_rank, pp_rank, ep_rank, sizes)
                d.mkdir(parents=True, exist_ok=True)
                # clone: each rank file owns its tensors (a view would save the whole source)
                torch.save({"model": {k: v.clone() for k, v in piece.items()}, "checkpoint_version": 3.0},
                           d / "model_optim_rng.pt")
                written.append(d / "model_optim_rng.pt")
    (out / "latest_checkpointed_iteration.txt").write_text("release")
    (out / LAYOUT_FILE).write_text(json.dumps({"tp": sizes.tp, "pp": sizes.pp, "ep": sizes.ep}) + "\n")
    keep = out / "hf"
    keep.mkdir(exist_ok=True)
    for f in hf_dir.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json", ".bin")):
            shutil.copy2(f, keep / f.name)
    config = json.loads((keep / "config.json").read_text())
    if config.pop("quantization_config", None) is not None:  # FP8 source: read dequantized
        (keep / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return written


def megatron_to_hf_dir(meg_dir: str | Path, out_dir: str | Path) -> None:
    """Join every rank file of a Megatron checkpoint (written by hf-to-megatron) into a HF directory."""
    meg = Path(meg_dir)
    layout = meg / LAYOUT_FILE
    if not layout.exists():
        raise FileNotFoundError(f"{layout} is missing: {meg} was not written by `milepost convert hf-to-megatron`")
    sizes = ParallelSizes(**{k: int(v) for k, v in json.loads(layout.read_text()).items()})
    shape = shape_of(json.loads((meg / "hf" / "config.json").read_text()))
    pieces = {}
    for pp_rank in range(sizes.pp):
        for ep_rank in range(sizes.ep):
            for tp_rank in range(sizes.tp):
                f = rank_dir(meg, tp_rank, pp_rank, ep_rank, sizes) / "model_optim_rng.pt"
                if not f.exists():
                    raise FileNotFoundError(f"{f} is missing (layout {sizes})")
                pieces[(tp_rank, pp_rank, ep_rank)] = torch.load(f, map_location="cpu", weights_only=True)["model"]
    hf = megatron_to_hf(shape, unshard(shape, pieces, tp=sizes.tp, pp=sizes.pp, ep=sizes.ep))
    write_hf_directory(hf.items(), meg / "hf", out_dir)
