"""The shape classifier: a small CNN trained on the synthetic shapes, used as a quality reward
(probability of the conditioned class) and as the image-quality check of an RL run (accuracy of
generated images against the class they were asked for). No OCR, no download.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from milepost.diffusion.shapes import CLASSES, make_dataset

WEIGHTS_FILE = "classifier.safetensors"


class ShapeClassifier(nn.Module):
    """logits [B, len(CLASSES)] of images [B, 3, 32, 32] in [-1, 1]."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 2, stride=2), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool2d(2),
            nn.Flatten(), nn.Linear(128, len(CLASSES)))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # Colour is no feature of the class: the net sees each pixel's distance from the grey
        # background (one channel), which keeps it small and cheap on a CPU.
        return self.net(images.float().abs().amax(dim=1, keepdim=True))


def train_classifier(steps: int = 300, seed: int = 0, batch: int = 64) -> tuple[ShapeClassifier, float]:
    """(classifier, held-out accuracy). Trained with pixel noise so slightly noisy samples still count."""
    torch.manual_seed(seed)
    images, labels = make_dataset(steps * batch // 4, seed=seed + 1000)
    held_x, held_y = make_dataset(600, seed=seed + 2000)
    model = ShapeClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    x_all, y_all = torch.from_numpy(images), torch.from_numpy(labels)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = torch.from_numpy(rng.integers(0, len(x_all), size=batch))
        x = x_all[idx] + 0.1 * torch.randn_like(x_all[idx])
        loss = F.cross_entropy(model(x), y_all[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), accuracy(model, torch.from_numpy(held_x), torch.from_numpy(held_y))


@torch.no_grad()
def accuracy(model: ShapeClassifier, images: torch.Tensor, labels: torch.Tensor) -> float:
    return float((model(images.float()).argmax(-1) == labels).float().mean())


def save_classifier(model: ShapeClassifier, path: str | Path) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / WEIGHTS_FILE))
    return path


def load_classifier(path: str | Path) -> ShapeClassifier:
    from safetensors.torch import load_file

    file = Path(path) / WEIGHTS_FILE
    if not file.is_file():
        raise ValueError(f"{path} holds no {WEIGHTS_FILE}; build it with `python -m milepost.diffusion.prepare DIR`")
    model = ShapeClassifier()
    model.load_state_dict(load_file(str(file)))
    return model.eval()
