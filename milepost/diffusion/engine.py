"""The diffusion rollout engine: a model, its weight version, SDE sampling and weight loading.

One lock serializes generation and weight changes, so an update lands between two batches. A
weight update is checked completely (names, shapes) before any weight changes. LoRA adapters
(`<module>.lora_A.weight` / `.lora_B.weight`) are merged on arrival: weight = base + B @ A, with
the base kept from the last full update, so each adapter replaces the previous one.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from milepost.diffusion import lora
from milepost.diffusion.model import TinyDiT, load_model
from milepost.diffusion.sde import Trajectory, sample
from milepost.weights.codec import WeightUpdateError
from milepost.weights.verify import tensor_digest


class DiffusionEngine:
    def __init__(self, model_dir: str | Path, device: str = "cpu", attention: str = "math",
                 deterministic: bool = False) -> None:
        if deterministic:
            from milepost.diffusion.precision import set_deterministic

            set_deterministic(0)
        self.model: TinyDiT = load_model(model_dir, device).eval()
        self.model.set_attention(attention)
        self.device = device
        self.weight_version = "0"
        self.lock = threading.Lock()
        self._base: dict[str, torch.Tensor] = {}  # weights adapters are merged onto

    @property
    def config(self):
        return self.model.config

    def generate(self, labels: list[int], *, seed: int, num_steps: int, guidance: float, noise_level: float,
                 shift: float) -> tuple[Trajectory, str]:
        with self.lock:
            traj = sample(self.model, torch.tensor(labels, dtype=torch.long), num_steps=num_steps, guidance=guidance,
                          noise_level=noise_level, seed=seed, shift=shift)
            if hasattr(self.model, "decode"):  # a latent model (diffusers pipeline): the VAE's images for rewards
                traj.images = self.model.decode(traj.latents[:, -1])
            return traj, self.weight_version

    def load_named(self, named: list[tuple[str, torch.Tensor]], version: str | None) -> int:
        """Apply full weights and/or adapters; WeightUpdateError naming every bad entry, nothing changed."""
        params = dict(self.model.state_dict())
        full: dict[str, torch.Tensor] = {}
        adapters: dict[str, dict[str, torch.Tensor]] = {}
        problems = []
        for name, t in named:
            if ".lora_A.weight" in name or ".lora_B.weight" in name:
                module, _, rest = name.partition(".lora_")
                target = f"{module}.weight"
                if target not in params:
                    problems.append(f"{name}: no module {module} with a weight to merge into")
                    continue
                adapters.setdefault(module, {})[rest.split(".")[0]] = t
            elif name not in params:
                problems.append(f"{name}: unknown weight")
            elif tuple(t.shape) != tuple(params[name].shape):
                problems.append(f"{name}: shape {tuple(t.shape)}, engine has {tuple(params[name].shape)}")
            else:
                full[name] = t
        for module, ab in adapters.items():
            w = params[f"{module}.weight"]
            if set(ab) != {"A", "B"}:
                problems.append(f"{module}: send both lora_A and lora_B")
            elif ab["A"].dim() != 2 or ab["B"].dim() != 2 or ab["B"].shape[1] != ab["A"].shape[0] \
                    or (ab["B"].shape[0], ab["A"].shape[1]) != tuple(w.shape):
                problems.append(f"{module}: lora_B {tuple(ab['B'].shape)} @ lora_A {tuple(ab['A'].shape)} "
                                f"does not make {tuple(w.shape)}")
        if problems:
            raise WeightUpdateError("weight update refused: " + "; ".join(problems))
        with self.lock, torch.no_grad():
            for name, t in full.items():
                params[name].copy_(t.to(params[name].dtype))
                self._base.pop(name, None)
            for module, ab in adapters.items():
                w = params[f"{module}.weight"]
                base = self._base.setdefault(f"{module}.weight", w.detach().clone())
                w.copy_(lora.merge(base, ab["A"].to(w.device), ab["B"].to(w.device)))
            if version is not None:
                self.weight_version = str(version)
        return len(full) + 2 * len(adapters)

    def receive_broadcast(self, group: object, names: list[str], dtypes: list[str], shapes: list[list[int]],
                          version: str | None) -> int:
        """`/update_weights_from_distributed`: receive the trainer's broadcast (CPU buffers, gloo) and
        apply it with `load_named`'s checks. Everything announced is received before any check refuses,
        so the trainer's broadcast completes and the group stays in step; the size is capped first."""
        from milepost.engine.weight_update import parse_dtype

        specs = [(parse_dtype(d), [int(s) for s in shp]) for d, shp in zip(dtypes, shapes, strict=True)]
        limit = 4 * sum(v.numel() * v.element_size() for v in self.model.state_dict().values())
        announced = sum(torch.Size(shp).numel() * dt.itemsize for dt, shp in specs)
        if announced > limit or any(s < 0 for _, shp in specs for s in shp):
            raise WeightUpdateError(f"weight update refused: {announced} bytes announced, more than 4x this "
                                    f"model's {limit // 4} (or a negative shape); the group is out of step, destroy it")
        buffers = [torch.empty(shp, dtype=dt) for dt, shp in specs]
        group.broadcast_many(buffers, src=0)  # type: ignore[attr-defined]
        return self.load_named(list(zip(names, buffers, strict=True)), version)

    def load_dir(self, path: str | Path, version: str | None) -> int:
        from safetensors.torch import load_file

        file = Path(path) / "model.safetensors"
        if not file.is_file():
            raise WeightUpdateError(f"model_path {path}: no model.safetensors there")
        return self.load_named(list(load_file(str(file)).items()), version)

    def checksums(self) -> dict[str, str]:
        with self.lock:
            return {k: tensor_digest(v.float()) for k, v in self.model.state_dict().items()}
