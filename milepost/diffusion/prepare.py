"""Build the tiny diffusion model and its data: `python -m milepost.diffusion.prepare OUT_DIR`.

OUT_DIR/base_model (tiny DiT trained with the flow-matching loss on synthetic shapes),
OUT_DIR/classifier (the shape classifier), OUT_DIR/sft_images.npz (bright shapes, the SFT
objective's data) and OUT_DIR/prepare.json (settings, timings and checks: classifier held-out
accuracy, the base model's sampled classifier accuracy). A complete OUT_DIR is reused.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

STAMP = "prepare.json"
VERSION = 3
# v3: larger shapes (shapes.R_MIN), width 64, 1500 steps of 32 images (v2: 600 of 64 at width 48
# drew the requested class 0.4-0.5 of the time; this one 0.78 at guidance 4, docs/diffusion.md).
SETTINGS = {"version": VERSION, "n_images": 4000, "pretrain_steps": 1500, "pretrain_batch": 32,
            "classifier_steps": 200, "dim": 64, "depth": 3, "patch": 4, "seed": 0}


def _bright_set(n: int, seed: int):  # -> (images, labels); numpy only imported when building
    """The brightest n of 3n synthetic shapes: what SFT should move the model toward."""
    import numpy as np

    from milepost.diffusion.shapes import make_dataset

    images, labels = make_dataset(n * 3, seed)
    lum = ((images + 1) / 2).mean(axis=(1, 2, 3))
    keep = np.argsort(-lum)[:n]
    return images[keep], labels[keep]


def prepare(out_dir: str | Path, *, force: bool = False, log_every: int = 0) -> Path:
    """Build (or reuse) OUT_DIR; returns it."""
    out = Path(out_dir)
    stamp = out / STAMP
    if not force and stamp.is_file() and json.loads(stamp.read_text()).get("settings") == SETTINGS:
        return out
    import numpy as np
    import torch

    from milepost.diffusion.base_model import pretrain
    from milepost.diffusion.classifier import (
        accuracy,
        save_classifier,
        train_classifier,
    )
    from milepost.diffusion.model import DiTConfig, save_model
    from milepost.diffusion.sde import sample
    from milepost.diffusion.shapes import make_dataset

    s = SETTINGS
    out.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    t0 = time.perf_counter()
    clf, clf_acc = train_classifier(steps=s["classifier_steps"], seed=s["seed"])
    save_classifier(clf, out / "classifier")
    images, labels = make_dataset(s["n_images"], s["seed"])
    cfg = DiTConfig(dim=s["dim"], depth=s["depth"], patch=s["patch"])
    model, info = pretrain(images, labels, steps=s["pretrain_steps"], batch=s["pretrain_batch"], seed=s["seed"],
                           config=cfg, log_every=log_every)
    save_model(model, out / "base_model")
    bright_x, bright_y = _bright_set(1000, s["seed"] + 7)
    np.savez(out / "sft_images.npz", images=bright_x, labels=bright_y)
    probe = torch.arange(48) % cfg.num_classes
    sampled = {}
    for guidance in (1.0, 4.0):  # how often the classifier sees the class asked for (chance: 1/3)
        traj = sample(model, probe, num_steps=8, guidance=guidance, noise_level=0.7, seed=123)
        sampled[f"cfg{guidance:g}"] = round(accuracy(clf, traj.latents[:, -1].clamp(-1, 1), probe), 4)
    report = {"settings": SETTINGS, "seconds": round(time.perf_counter() - t0, 1), "pretrain": info,
              "classifier_heldout_accuracy": round(clf_acc, 4), "base_sampled_classifier_accuracy": sampled}
    stamp.write_text(json.dumps(report, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m milepost.diffusion.prepare", description=__doc__)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--force", action="store_true", help="rebuild even if OUT_DIR is complete")
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: the model's matrices are small; on the shared 2-core machine at "
                         "load 8-11 a pretraining step with two threads took several times longer than with one)")
    args = ap.parse_args(argv)
    from milepost.launch.process import openmp_defaults

    os.environ.update(openmp_defaults())
    import torch

    torch.set_num_threads(args.threads)
    out = prepare(args.out_dir, force=args.force, log_every=args.log_every)
    info = json.loads((out / STAMP).read_text())
    print(f"tiny DiT in {out}/base_model ({info['seconds']}s): classifier held-out accuracy "
          f"{info['classifier_heldout_accuracy']}, base model's samples classified right "
          f"{info['base_sampled_classifier_accuracy']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
