"""Static activation scales in the fp8_block engines (`--fp8-activation-scheme static`).

The trainer under `--fp8-scaling delayed` quantizes each FP8 linear's input with one float32
scale from its amax history; it sends that scale with every weight update as
`<module>.input_scale` (0-d float32, the name FP8 checkpoints with `activation_scheme: static`
give it), and the engine's linear quantizes its input with `delayed.qdq_input`, the trainer's
own function, so the engine's forward of a version is the trainer's forward of those weights.
A fused projection (qkv_proj, gate_up_proj) multiplies one input, so its parts' scales must be
equal bit for bit (the trainer's q/k/v and gate/up record the same input): every part name
addresses its own element of the module's `input_scale` buffer (so checksums and the equality
check see what was sent for each name), and an update that would leave them unequal is refused
before anything is copied. 0 = no scale yet: the 1 x 128 current blocks (as the trainer's
first step). The scales are plain tensors to the weight loader: every transport carries them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from milepost.lowprec.delayed import input_scale_name
from milepost.weights.codec import WeightUpdateError

SCALE_SUFFIX = ".input_scale"


def is_input_scale(name: str) -> bool:
    """An FP8 linear's static activation scale (float32 on the wire: never cast to the model
    dtype, it would round)."""
    return name.endswith(SCALE_SUFFIX)


class InputScales:
    """The engine's static input scales by HF name, and the fused modules' equality rule."""

    def __init__(self, parts: dict[str, tuple[nn.Module, int]]) -> None:
        self._parts = parts  # "<module>.input_scale" -> (quantized linear, part index)
        self._by_buffer: dict[int, nn.Module] = {}
        self._open: dict[int, dict[int, float]] = {}  # fused module -> parts written this update

    def names(self) -> list[str]:
        return list(self._parts)

    def view(self, name: str) -> torch.Tensor | None:
        """The 0-d element `name` addresses, or None when it is not a static input scale."""
        hit = self._parts.get(name)
        return None if hit is None else hit[0].input_scale[hit[1]]

    def _owner(self, dst: torch.Tensor) -> tuple[nn.Module, int] | None:
        ptr = dst.untyped_storage().data_ptr()
        module = self._by_buffer.get(ptr)
        if module is None:  # buffers move on release / resume: map them again
            self._by_buffer = {m.input_scale.untyped_storage().data_ptr(): m
                               for m, _ in self._parts.values()}
            module = self._by_buffer.get(ptr)
        if module is None:
            return None
        return module, (dst.data_ptr() - module.input_scale.data_ptr()) // 4

    def check(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Refuse (WeightUpdateError, nothing copied) scales that would leave a fused module's
        parts unequal: within these pairs, or against the parts an earlier request of the same
        update wrote (an update is over once every part was written, or when a part comes
        again)."""
        sent: dict[int, tuple[nn.Module, dict[int, float]]] = {}
        for dst, src in pairs:
            if dst.dim() != 0 or dst.dtype != torch.float32:  # weights are never 0-d
                continue
            hit = self._owner(dst)
            if hit is not None and hit[0].input_scale.numel() > 1:
                sent.setdefault(id(hit[0]), (hit[0], {}))[1][hit[1]] = float(src)
        problems, merged_of = [], {}
        for key, (module, values) in sent.items():
            earlier = self._open.get(key, {})
            if any(j in earlier for j in values):
                earlier = {}  # a part again: a new update began
            merged = {**earlier, **values}
            merged_of[key] = (module, merged)
            if len(set(merged.values())) > 1:
                names = self._names_of(module)
                problems.append(", ".join(f"{names[j]}={v!r}" for j, v in sorted(merged.items())))
        if problems:
            raise WeightUpdateError(
                "weight update refused, no weight was changed: a fused projection multiplies one "
                "input, so its parts' static input scales must be equal bit for bit (the "
                "trainer's q/k/v and gate/up quantize the same input): " + "; ".join(problems))
        for key, (module, merged) in merged_of.items():
            if len(merged) == module.input_scale.numel():
                self._open.pop(key, None)
            else:
                self._open[key] = merged

    def _names_of(self, module: nn.Module) -> dict[int, str]:
        return {j: n for n, (m, j) in self._parts.items() if m is module}


def attach_input_scales(model: nn.Module, modules: Iterable[tuple[nn.Module, list[str]]]
                        ) -> InputScales:
    """Give each fp8_block linear (with the HF weight names of its parts) a float32
    `input_scale` buffer [parts] of zeros and let the model's `weight_view` /
    `hf_weight_names` address its elements as `<part>.input_scale`."""
    parts: dict[str, tuple[nn.Module, int]] = {}
    for module, names in modules:
        module.register_buffer("input_scale", torch.zeros(len(names), dtype=torch.float32,
                                                          device=module.weight.device))
        module.qstatic = True
        for j, name in enumerate(names):
            parts[input_scale_name(name)] = (module, j)
    scales = InputScales(parts)
    base_view, base_names = model.weight_view, model.hf_weight_names

    def weight_view(name: str) -> torch.Tensor:
        view = scales.view(name) if is_input_scale(name) else None
        return view if view is not None else base_view(name)

    def hf_weight_names() -> list[str]:
        return base_names() + scales.names()

    model.weight_view = weight_view  # type: ignore[method-assign]
    model.hf_weight_names = hf_weight_names  # type: ignore[method-assign]
    return scales


def load_checkpoint_scales(scales: InputScales, model_path: str) -> int:
    """Read a checkpoint's `*.input_scale` tensors (a trainer's export under delayed scaling, an
    FP8 checkpoint with `activation_scheme: static`) into the engine; returns how many."""
    from pathlib import Path

    from safetensors import safe_open

    names, found = set(scales.names()), []
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            found += [(n, h.get_tensor(n)) for n in h.keys() if n in names]
    pairs = [(scales.view(n), t.reshape(()).float()) for n, t in found]
    scales.check(pairs)
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src)
    return len(pairs)
