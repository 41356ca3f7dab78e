"""Delayed FP8 scaling for the trainer (`--fp8-scaling delayed`, Transformer Engine's recipe).

What it changes: only what the trainer alone quantizes. Each FP8 blockwise linear's input
activation (forward GEMM, and the weight-gradient GEMM) and its output gradient (data- and
weight-gradient GEMMs) get one E4M3 scale per tensor, taken from the amaxes of earlier optimizer
steps, instead of one scale per 1 x 128 block from the tensor itself. The weights keep the shared
quantizer's 128 x 128 tiles (milepost/lowprec/quantize.py: the engines, conversion and export
compute the same bits), so the contract's weights do not change. The input scales travel to the
engines with every weight update as `<module>.input_scale` (FP8 checkpoints' static activation
scales), and the engines quantize their inputs with `qdq_input`, the function the trainer's
forward calls, so both sides compute the same activations (engine_store.py, `input_scales`).

The history: each slot (a weight's input `x` or output gradient `gy`) keeps the amax of the last
`history_len` optimizer steps. Within a step every training forward and backward max-es its
tensor's amax into the step's slot (micro-batches and activation recompute included; the
scoring passes under no_grad only read); when the step ends the slots are max-reduced over the
data-parallel group in one all_reduce, so every rank uses the same scales and the scales do not
depend on how the batch was split, then pushed into the history and the scales recomputed:
`scale = amax_h * 2^margin / 448`, amax_h the history's largest ("max") or the last step's
("most_recent"). A slot whose amax_h is zero or not finite keeps its scale (as TE does). A slot
with no positive amax in its history yet (the first step) quantizes as current scaling does: an
input by 1 x 128 blocks (what an engine without a scale does: the first rollout matches too), an
output gradient by its own per-tensor amax; TE starts from scale 1, which would flush small
gradients to zero in E4M3. On CUDA devices with FP8 GEMMs the linears run them natively on
these values (milepost/kernels/fp8_delayed.py); elsewhere the GEMMs are emulated.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from milepost.lowprec import elements as el
from milepost.lowprec.linear import quantize_activation

log = logging.getLogger(__name__)
AmaxAlgo = Literal["max", "most_recent"]


@dataclass(frozen=True)
class DelayedSettings:
    """TE's DelayedScaling knobs (its defaults: history 1024, "max", margin 0)."""

    history_len: int = 1024
    algo: AmaxAlgo = "max"
    margin: int = 0


def _amax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(largest finite magnitude, whether x holds NaN/Inf) as float32 / bool scalars."""
    xf = x.detach().float()
    finite = torch.isfinite(xf)
    return torch.where(finite, xf.abs(), 0.0).amax(), ~finite.all()


def qdq_per_tensor(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x` quantized to E4M3 with one float32 `scale` (x / scale rounded to nearest even,
    saturating at 448) and dequantized back to x's dtype; a NaN scale gives NaN everywhere."""
    v = el.to_e4m3(x.detach().float() / scale)  # tensor / tensor: correctly rounded on any device
    return (v.float() * scale).to(x.dtype)


def qdq_input(x: torch.Tensor, scale: torch.Tensor, seen: bool | None = None) -> torch.Tensor:
    """An FP8 linear's input as its GEMM sees it under a delayed (static) float32 `scale`: one
    E4M3 scale per tensor where `scale` > 0, NaN everywhere if x holds NaN/Inf; `scale` 0 (no
    history yet) = current scaling's 1 x 128 blocks. The one function of the trainer's forward
    and the engines' (static `input_scale`): `seen` is the trainer's host copy of `scale > 0`;
    None decides on the device (no host sync, so CUDA graphs can capture it)."""
    if seen is False:
        return quantize_activation(x, "fp8_block")
    static = qdq_per_tensor(x, torch.where(_amax(x)[1], torch.nan, scale))
    if seen is True:
        return static
    return torch.where(scale > 0, static, quantize_activation(x, "fp8_block"))


def quantize_input_blocks(x2: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`qdq_input`'s rule for the block-scaled FP8 GEMMs (engines on Hopper): x2 [M, K], K a
    multiple of 128 -> (float8_e4m3fn [M, K], float32 [M, K/128] block scales), every block
    scaled by `scale` where it is > 0 (NaN if x2 holds NaN/Inf), else by its own amax (current
    scaling). Dequantized (values times their block's scale) they are qdq_input's values."""
    m, k = x2.shape
    t = x2.detach().float().reshape(m, k // 128, 128)
    finite = torch.isfinite(t)
    amax, bad = torch.where(finite, t.abs(), 0.0).amax(-1), ~finite.all(-1)
    current = torch.where(amax > 0, amax / torch.full_like(amax, el.E4M3_MAX), 1.0)  # quantize()'s
    current = torch.where(bad, torch.nan, current)
    static = torch.where(bad.any(), torch.nan, scale).expand(m, k // 128)
    s = torch.where(scale > 0, static, current)
    return el.to_e4m3(t / s[..., None]).reshape(m, k), s


def input_scale_name(weight_name: str) -> str:
    """'...q_proj.weight' -> '...q_proj.input_scale' (FP8 checkpoints' static activation scale)."""
    return weight_name.removesuffix(".weight") + ".input_scale"


class DelayedScaling:
    """The amax history and scales of one trained model's FP8 linears (see the module docstring)."""

    def __init__(self, names: Sequence[str], settings: DelayedSettings, device: torch.device) -> None:
        self.settings = settings
        self.slots = [f"{n}:{k}" for n in names for k in ("x", "gy")]
        s = len(self.slots)
        self.history = torch.zeros(settings.history_len, s, dtype=torch.float32, device=device)
        self.scale = torch.ones(s, dtype=torch.float32, device=device)
        self.pending = torch.zeros(s, dtype=torch.float32, device=device)
        self.updates = 0
        self._seen = [False] * s  # host copy: a slot with a positive amax in its history

    def slot(self, name: str, kind: str) -> int:
        return self.slots.index(f"{name}:{kind}")

    def _current_scale(self, amax: torch.Tensor) -> torch.Tensor:
        scaled = amax * 2.0 ** self.settings.margin  # a power of two: exact
        return torch.where(amax > 0, scaled / torch.full_like(scaled, el.E4M3_MAX), 1.0)

    def operand_scale(self, x: torch.Tensor, slot: int, record: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 scale, whether x holds NaN/Inf) that `x` quantizes with in `slot`; `record`
        adds its amax to the step. The scale is the history's; with no history yet 0 for an
        input (its own 1 x 128 blocks) and the tensor's own amax's for an output gradient."""
        amax, bad = _amax(x)
        if record:
            self.record(slot, amax)
        if self._seen[slot]:
            return self.scale[slot], bad
        if slot % 2 == 0:  # an input ("x" slots are even)
            return torch.zeros((), dtype=torch.float32, device=x.device), bad
        return self._current_scale(amax), bad

    def record(self, slot: int, amax: torch.Tensor) -> None:
        """Max a tensor's amax (float32 0-d, its finite values') into this step's slot."""
        self.pending[slot] = torch.maximum(self.pending[slot], amax)

    def seen(self, slot: int) -> bool:
        """Whether `slot` has a positive amax in its history (host copy: no device sync)."""
        return self._seen[slot]

    def qdq(self, x: torch.Tensor, slot: int, record: bool) -> torch.Tensor:
        """`x` as the FP8 GEMM sees it under this slot's scale; `record` adds its amax to the step."""
        scale, bad = self.operand_scale(x, slot, record)
        if slot % 2 == 0:  # an input: the engines' function (qdq_input)
            return qdq_input(x, scale, self._seen[slot])
        return qdq_per_tensor(x, torch.where(bad, torch.nan, scale))

    def step(self, group: dist.ProcessGroup | None = None) -> None:
        """End of an optimizer step (collective over `group` when it has several ranks)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(self.pending, op=dist.ReduceOp.MAX, group=group)
        self.history = torch.roll(self.history, 1, 0)
        self.history[0] = self.pending
        self.pending.zero_()
        self.updates += 1
        filled = self.history[: min(self.updates, self.settings.history_len)]
        amax_h = filled.amax(0) if self.settings.algo == "max" else self.history[0]
        ok = (amax_h > 0) & torch.isfinite(amax_h)
        self.scale = torch.where(ok, self._current_scale(amax_h), self.scale)
        self._seen = [a or b for a, b in zip(self._seen, ok.tolist())]  # one host sync a step

    def input_scales(self) -> list[tuple[str, torch.Tensor]]:
        """(`<module>.input_scale`, float32 0-d) of every FP8 linear: the scales the trainer's
        forwards use from now until the next `step()`, so sent with the weights of this step
        they make the engines' forward of that version the trainer's; 0 = no history yet (both
        sides then quantize per 1 x 128 block)."""
        seen = torch.tensor(self._seen, device=self.scale.device)
        held = torch.where(seen, self.scale, 0.0)
        return [(input_scale_name(self.slots[i].removesuffix(":x")), held[i].clone())
                for i in range(0, len(self.slots), 2)]

    def state_dict(self) -> dict[str, Any]:
        return {"slots": list(self.slots), "history": self.history.cpu(), "scale": self.scale.cpu(),
                "pending": self.pending.cpu(), "updates": self.updates, "seen": list(self._seen),
                "history_len": self.settings.history_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved history (exact resume); refuses one of another model or length."""
        if state["slots"] != self.slots:
            raise ValueError("the checkpoint's FP8 amax history is for other linears "
                             f"({len(state['slots'])} slots, this model has {len(self.slots)}); "
                             "resume with the same --hf-checkpoint and precision overrides")
        if state["history_len"] != self.settings.history_len:
            raise ValueError(f"the checkpoint's FP8 amax history has length {state['history_len']}; "
                             f"resume with --fp8-amax-history-len {state['history_len']}")
        dev = self.scale.device
        self.history, self.scale = state["history"].to(dev), state["scale"].to(dev)
        self.pending = state["pending"].to(dev)
        self.updates, self._seen = int(state["updates"]), list(state["seen"])


class DelayedFp8LinearFn(torch.autograd.Function):
    """y = Qd(x) @ Q(w)^T; backward on Qd(gy): per-tensor delayed scales for x and gy (one
    quantized copy serves both GEMMs of each), the shared quantizer's weight, the weight's
    gradient straight through to the master."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, wq: torch.Tensor, state: DelayedScaling,
                slots: tuple[int, int], record: bool) -> torch.Tensor:
        xq = state.qdq(x, slots[0], record)
        ctx.save_for_backward(xq, wq)
        ctx.state, ctx.gy_slot = state, slots[1]
        return F.linear(xq, wq)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):  # type: ignore[override]
        xq, wq = ctx.saved_tensors
        gyq = ctx.state.qdq(gy, ctx.gy_slot, True)
        gy2, x2 = gyq.reshape(-1, gy.shape[-1]), xq.reshape(-1, xq.shape[-1])
        gx = gy2 @ wq
        gw = gy2.t() @ x2
        return gx.reshape(xq.shape), gw.to(wq.dtype), None, None, None, None


@torch.compiler.disable  # it updates the history in place and branches on host state: eager
def delayed_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A LowPrecLinear's forward under delayed scaling (module.__dict__['_delayed'] is set);
    under --compile-layers the rest of the layer compiles around it."""
    from milepost.kernels.fp8_delayed import DelayedFp8NativeFn, runs_native
    from milepost.lowprec.linear import fp8_options_arg, native_weight

    state, slots, records = module.__dict__["_delayed"]
    record = records and torch.is_grad_enabled()  # scoring passes under no_grad only read
    gemms = runs_native(module.weight, x)
    if gemms is not None:  # FP8 GEMMs on the same values (kernels/fp8_delayed.py)
        wv, ws, wvt = native_weight(module)  # the shared quantizer's tiles
        y = DelayedFp8NativeFn.apply(x, module.weight, wv, ws, state, slots, record, gemms,
                                     fp8_options_arg(module), wvt)
    else:
        y = DelayedFp8LinearFn.apply(x, module.weight, module.quantized_weight(), state, slots, record)
    return y + module.bias if module.bias is not None else y


def fp8_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(HF weight name, module) of `model`'s FP8 blockwise trainer linears, in module order."""
    from milepost.lowprec.linear import LowPrecLinear, _hf_name

    return [(_hf_name(n) + ".weight", m) for n, m in model.named_modules()
            if isinstance(m, LowPrecLinear) and m.qformat == "fp8_block"]


def attach_delayed(model: nn.Module, settings: DelayedSettings, device: torch.device,
                   readers: Sequence[nn.Module] = ()) -> DelayedScaling:
    """Delayed scaling for the trained `model`'s FP8 linears; `readers` (the reference model: the
    same tensors, never trained) use its scales without recording, so policy and reference
    quantize alike while their weights agree."""
    linears = fp8_linears(model)
    state = DelayedScaling([n for n, _ in linears], settings, device)
    for m, records in [(model, True), *((r, False) for r in readers)]:
        for name, lin in fp8_linears(m):
            lin.__dict__["_delayed"] = (state, (state.slot(name, "x"), state.slot(name, "gy")), records)
    log.info("--fp8-scaling delayed: %d linears, amax history %d (%s), margin %d", len(linears),
             settings.history_len, settings.algo, settings.margin)
    return state
