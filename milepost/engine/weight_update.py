"""Loads new weights into a running engine's model, all-or-nothing.

Every update is staged first (names resolved through `model.weight_view`, shapes and dtypes
checked, every problem collected) and only then committed by in-place copies, so a refused update
leaves the old weights fully in place. Sources follow SGLang's update endpoints: serialized
tensors, a Hugging Face directory on disk, and a broadcast over a weight group.
"""

from __future__ import annotations

import bisect
import contextlib
import difflib
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from milepost.weights.codec import WeightUpdateError, deserialize_named_tensors
from milepost.weights.p2p_ipc import receive_ipc_bucket
from milepost.weights.p2p_layout import flat_layout, unpack
from milepost.weights.process_group import WeightGroup

__all__ = ["WeightLoader", "WeightUpdateError", "parse_dtype"]

_MAX_LISTED_PROBLEMS = 40  # a wrong model can produce thousands; the first few tell the story
# Checkpoint entries that are derived state, not weights (old Llama exports saved RoPE tables);
# the model loader (milepost/models/registry.py) skips the same ones.
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)
# safetensors header dtype names -> torch dtypes (the ones torch can hold).
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}



def _fp8_scales(root: Path, handles: list) -> dict[str, object] | None:
    """{`X.weight_scale_inv`: its file handle} of an FP8 blockwise checkpoint; None for an
    unquantized one; another quantized layout is refused (an update sends the weights' values)."""
    from milepost.lowprec.fp8_checkpoint import SCALE_INV_SUFFIX
    from milepost.lowprec.quant_checkpoint import checkpoint_quant

    try:
        ckpt = checkpoint_quant(root)
    except ValueError as e:
        raise WeightUpdateError(str(e)) from e
    if ckpt is None:
        return None
    if ckpt.layout != "fp8_block" or ckpt.scale_suffix != SCALE_INV_SUFFIX:
        raise WeightUpdateError(f"{root}: a {ckpt.layout} checkpoint; /update_weights_from_disk "
                                "reads unquantized and FP8 blockwise (weight_scale_inv) checkpoints: "
                                "send the dequantized weights (or start an engine on this checkpoint)")
    return {n: h for h in handles for n in h.keys() if n.endswith(SCALE_INV_SUFFIX)}


def _read_dequantized(handle: object, name: str, scales: dict[str, object]) -> torch.Tensor:
    from milepost.lowprec.fp8_checkpoint import SCALE_INV_SUFFIX, checkpoint_qtensor
    from milepost.lowprec.quantize import dequantize

    t = handle.get_tensor(name)
    if t.dtype != torch.float8_e4m3fn:
        return t
    scale = name.removesuffix(".weight") + SCALE_INV_SUFFIX
    return dequantize(checkpoint_qtensor(name, t, scales[scale].get_tensor(scale) if scale in scales else None))

class WeightAddressable(Protocol):
    """The part of the model contract (milepost/models/base.py) that weight loading uses."""

    def weight_view(self, hf_name: str) -> torch.Tensor: ...

    def hf_weight_names(self) -> list[str]: ...


def parse_dtype(name: str) -> torch.dtype:
    """Parse a dtype name as SGLang sends it: 'bfloat16' or 'torch.bfloat16' -> torch.bfloat16."""
    attr = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(attr, torch.dtype):
        raise WeightUpdateError(f"unknown dtype {name!r}; use a torch dtype name like 'bfloat16'")
    return attr


class WeightLoader:
    """Copies named Hugging Face tensors into `model`'s parameters, refusing bad updates whole.

    Not thread-safe with the forward pass: the engine must call the load methods between steps
    (no batch may run while a commit is half done).
    """

    def __init__(self, model: WeightAddressable) -> None:
        self.model = model
        # --quantization fp8: these views are fp8 rows; updates arrive in the model's dtype and
        # are quantized in commit (milepost/engine/weight_fp8.py).
        self.fp8 = getattr(model, "fp8_weights", None)

    # -- staging and commit: the two halves every source goes through -------------------------

    def stage(
        self, named: Iterable[tuple[str, torch.Tensor]], *, strict_dtype: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Resolve and check every (hf_name, tensor); return (destination view, source) pairs.

        Copies nothing. With strict_dtype a dtype difference is an error, else the commit casts
        (floating <-> non-floating casts are always refused). Raises one WeightUpdateError that
        lists every problem; then one for NaN or infinite values.
        """
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        names: list[str] = []
        problems: list[str] = []
        seen: set[str] = set()
        for name, src in named:
            if not isinstance(src, torch.Tensor):
                problems.append(f"{name}: expected a tensor, got {type(src).__name__}")
                continue
            view = self._check(name, tuple(src.shape), src.dtype, strict_dtype, seen, problems)
            if view is not None:
                pairs.append((view, src))
                names.append(name)
        self._raise_if(problems)
        self.refuse_non_finite(list(zip(names, (src for _, src in pairs))))
        return pairs

    @torch.no_grad()  # parameters may require grad (the trainer shares model code)
    def commit(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each source into its destination view (casting dtype, moving device; quantizing
        into an fp8 destination). Sources were checked (`stage`, `refuse_non_finite`) before;
        static FP8 input scales of a fused module must agree (lowprec/engine_scales.py)."""
        scales = getattr(self.fp8, "input_scales", None)
        if scales is not None:
            pairs = list(pairs)
            scales.check(pairs)  # raises before the first copy
        for dst, src in pairs:
            if self.fp8 is not None and self.fp8.owner(dst) is not None:
                self.fp8.write(dst, src)
            else:
                dst.copy_(src)
        after = getattr(self.model, "after_weight_commit", None)
        if after is not None:  # e.g. LoRA expert deltas re-merged (milepost/lora/expert_merge.py)
            after()

    @staticmethod
    def refuse_non_finite(named: Sequence[tuple[str, torch.Tensor]], note: str = "") -> None:
        """Raise WeightUpdateError naming every floating tensor that holds a NaN or an infinity.

        Every update path calls this before its first copy: NaN weights make every log-prob
        NaN and the engine would go on serving them. One reduction per tensor and a single
        device sync in all, so it stays cheap on GPU.
        """
        floats = [(n, t) for n, t in named if t.is_floating_point() and t.numel()]
        if not floats:
            return
        # float8 has no isfinite kernel: widen it (1-byte tensors, so the copy is small).
        flags = [torch.isfinite(t if t.element_size() > 1 else t.half()).all() for _, t in floats]
        ok = [False] * len(flags)
        for device in {f.device for f in flags}:  # one host sync per device
            at = [i for i, f in enumerate(flags) if f.device == device]
            for i, fine in zip(at, torch.stack([flags[i] for i in at]).tolist()):
                ok[i] = fine
        WeightLoader._raise_if(
            [f"{n}: holds NaN or infinite values" for (n, _), fine in zip(floats, ok) if not fine],
            note or "; the sender's weights are not finite (check its loss and learning rate)")

    # -- sources -----------------------------------------------------------------------------

    def from_named(
        self, named: Iterable[tuple[str, torch.Tensor]], *, strict_dtype: bool = False
    ) -> int:
        """Stage then commit `named`; returns how many tensors were written."""
        pairs = self.stage(named, strict_dtype=strict_dtype)
        self.commit(pairs)
        return len(pairs)

    def from_tensors(self, serialized: str, *, strict_dtype: bool = False) -> int:
        """`/update_weights_from_tensor`: one entry of `serialized_named_tensors` (this TP rank's).

        Casts to the model dtype unless strict_dtype, like SGLang's loader.
        """
        return self.from_named(deserialize_named_tensors(serialized), strict_dtype=strict_dtype)

    def from_disk(self, model_path: str, *, require_complete: bool = True) -> int:
        """`/update_weights_from_disk`: every *.safetensors file of a Hugging Face directory.

        Shapes and dtypes are checked from the file headers before any tensor is read (an integer
        or bool tensor never lands in a floating weight), then every value is checked finite;
        floating tensors are cast to the model dtype. With require_complete, a checkpoint that lacks any of the model's weights
        is refused (a partial load would silently mix two checkpoints).
        """
        root = Path(model_path)
        if not root.is_dir():
            raise WeightUpdateError(f"model_path {model_path!r} is not a directory")
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise WeightUpdateError(
                f"model_path {model_path!r} holds no *.safetensors files; "
                "save the checkpoint with save_pretrained(safe_serialization=True)"
            )
        with contextlib.ExitStack() as stack:
            # Opening validates each header against its file size, so a truncated file fails here.
            try:
                handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
            except Exception as e:
                raise WeightUpdateError(f"cannot read safetensors under {model_path!r}: {e}") from e
            problems: list[str] = []
            seen: set[str] = set()
            plan: list[tuple[torch.Tensor, object, str]] = []
            # Tensors a checkpoint keeps beside the weights, read by no model (DeepSeek's copies
            # of the embedding and head under its MTP layers, models/mtp.py).
            unread = getattr(self.model, "skip_checkpoint_name", None)
            # An FP8 blockwise checkpoint: each float8 weight arrives dequantized (its
            # weight_scale_inv applied, lowprec/fp8_checkpoint.py) and is stored as any update.
            scales = _fp8_scales(root, handles)
            for handle in handles:
                for name in handle.keys():
                    if name.endswith(_DERIVED_SUFFIXES) or (unread is not None and unread(name)):
                        continue
                    if scales is not None and name in scales:
                        continue  # read with its weight
                    header = handle.get_slice(name)
                    dtype = _SAFETENSORS_DTYPES.get(header.get_dtype())
                    if scales is not None and dtype == torch.float8_e4m3fn:
                        dtype = torch.float32  # what it dequantizes to
                    if dtype is None:
                        problems.append(f"{name}: safetensors dtype {header.get_dtype()} is not "
                                        "a weight dtype this engine loads")
                        continue
                    view = self._check(name, tuple(header.get_shape()), dtype, False, seen,
                                       problems)
                    if view is not None:
                        plan.append((view, handle, name))
            if require_complete:
                missing = self._uncovered([view for view, _, _ in plan])
                problems += [f"{name}: missing from {model_path!r}" for name in missing]
            self._raise_if(problems)
            # Two passes, one tensor in memory at a time: check every value, then copy.
            read = (lambda h, n: _read_dequantized(h, n, scales)) if scales is not None else (
                lambda h, n: h.get_tensor(n))
            try:
                for _, handle, name in plan:
                    self.refuse_non_finite([(name, read(handle, name))],  # type: ignore[attr-defined]
                                           f"; {model_path!r} holds non-finite weights")
            except ValueError as e:  # a float8 weight without its scale, or a misshapen one
                raise WeightUpdateError(f"{model_path!r}: {e}") from e
            for view, handle, name in plan:
                self.commit([(view, read(handle, name))])  # type: ignore[attr-defined]
        return len(plan)

    def from_distributed(
        self,
        group: WeightGroup,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        strict_dtype: bool = False,
    ) -> int:
        """`/update_weights_from_distributed`: receive the tensors the trainer (rank 0) broadcasts.

        Names, dtypes and shapes are checked against the model before receiving. If they describe
        well-formed tensors that the model refuses, the broadcasts are still received (into a
        scratch buffer, one at a time) and dropped before raising, so the trainer's broadcasts
        complete and the group stays usable; malformed metadata raises at once and leaves the
        group out of step (destroy and re-init it).
        """
        specs = self._parse_specs(names, dtypes, shapes)
        problems: list[str] = []
        seen: set[str] = set()
        views = [self._check(n, shp, dt, strict_dtype, seen, problems) for n, dt, shp in specs]
        if problems:
            for _, dtype, shape in specs:
                group.broadcast(torch.empty(shape, dtype=dtype, device=group.device), src=0)
            self._raise_if(problems, "; the broadcast was received and dropped")
        # Fresh buffers in the declared dtype (the wire carries exactly that), on the parameter's
        # own GPU for nccl (the communicator binds to the device of the first tensor it moves).
        nccl = group.backend == "nccl"
        buffers = [
            torch.empty(shape, dtype=dtype, device=view.device if nccl else group.device)  # type: ignore[union-attr]
            for (_, dtype, shape), view in zip(specs, views)
        ]
        group.broadcast_many(buffers, src=0)
        self.refuse_non_finite([(n, buf) for (n, _, _), buf in zip(specs, buffers)],
                               "; the broadcast was received and dropped (the trainer's weights "
                               "are not finite)")
        pairs = [(view, buf) for view, buf in zip(views, buffers) if view is not None]
        self.commit(pairs)  # every view was checked above against exactly these shapes/dtypes
        return len(pairs)

    def from_p2p(
        self,
        group: WeightGroup | None,
        src_rank: int,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        strict_dtype: bool = False,
        ipc_handle: str | None = None,
    ) -> int:
        """`/update_weights_from_p2p`: receive one packed bucket from `src_rank` (milepost.weights.p2p).

        Like `from_distributed`: well-formed metadata that the model refuses still receives the
        bytes (so the sender's write completes) and then raises; nothing is copied. With
        `ipc_handle` (same host, CUDA) the bucket is copied out of the source's staging buffer
        instead (milepost.weights.p2p_ipc) and `group` is not used; a refused bucket is not read.
        """
        specs = self._parse_specs(names, dtypes, shapes)
        problems: list[str] = []
        seen: set[str] = set()
        views = [self._check(n, shp, dt, strict_dtype, seen, problems) for n, dt, shp in specs]
        dts = [dt for _, dt, _ in specs]
        shps = [shp for _, _, shp in specs]
        _, total = flat_layout(shps, dts)
        if ipc_handle is not None:
            self._raise_if(problems, "; the CUDA IPC bucket was not read")
            device = views[0].device if views else torch.device("cpu")
            flat = receive_ipc_bucket(ipc_handle, total, device)
            tensors = unpack(flat, shps, dts)
            self.refuse_non_finite([(n, t) for (n, _, _), t in zip(specs, tensors)])
            pairs = [(v, t) for v, t in zip(views, tensors) if v is not None]
            self.commit(pairs)
            return len(pairs)
        if group is None:
            raise WeightUpdateError("a p2p bucket without ipc_handle needs a weight group")
        device = group.device
        if group.backend == "nccl" and views and views[0] is not None:
            device = views[0].device
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        if total:
            group.recv(flat, src_rank).wait()
        self._raise_if(problems, "; the bytes were received and dropped")
        tensors = unpack(flat, shps, dts)
        self.refuse_non_finite([(n, t) for (n, _, _), t in zip(specs, tensors)],
                               "; the bytes were received and dropped (the sender's weights are "
                               "not finite)")
        pairs = [(v, t) for v, t in zip(views, tensors) if v is not None]
        self.commit(pairs)
        return len(pairs)

    # -- helpers -----------------------------------------------------------------------------

    def _check(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype | None,
        strict_dtype: bool,
        seen: set[str],
        problems: list[str],
    ) -> torch.Tensor | None:
        """The destination view for `name`, or None after appending why it cannot take the data."""
        if name in seen:
            problems.append(f"{name}: appears twice in one update")
            return None
        seen.add(name)
        try:
            view = self.model.weight_view(name)
        except KeyError as e:
            if name.endswith(".input_scale"):  # a delayed-scaling FP8 trainer's static scales
                problems.append(f"{name}: this engine takes no static FP8 input scales; start it "
                                "with --quantization fp8_block --fp8-activation-scheme static (a "
                                "trainer under --fp8-scaling delayed sends them)")
                return None
            # Hints cost a fuzzy search over all names; only listed problems get one.
            hint = self._unknown_hint(name, e) if len(problems) < _MAX_LISTED_PROBLEMS else ""
            problems.append(f"{name}: unknown name for this model{hint}")
            return None
        quantized = self.fp8 is not None and self.fp8.owner(view) is not None
        # A packed INT4 view is half as wide as the tensor sent (lowprec/engine_store.py).
        want = self.fp8.hf_shape(view) if quantized and hasattr(self.fp8, "hf_shape") else \
            tuple(view.shape)
        if want != shape:
            problems.append(f"{name}: shape mismatch, model expects {list(want)}, got {list(shape)}")
            return None
        expected = view.dtype
        if quantized:
            expected = self.fp8.source_dtype  # stored quantized, sent in the model's dtype
        if dtype is not None and dtype != expected:
            if strict_dtype:
                problems.append(
                    f"{name}: dtype mismatch, model expects {expected}, got {dtype} "
                    "(strict dtype; send the model's dtype or allow casting)"
                )
                return None
            if dtype.is_floating_point != expected.is_floating_point:
                problems.append(f"{name}: cannot cast {dtype} into the model's {expected}")
                return None
        return view

    def _unknown_hint(self, name: str, err: KeyError) -> str:
        detail = f" ({err.args[0]})" if err.args else ""
        close = difflib.get_close_matches(name, self.model.hf_weight_names(), n=1, cutoff=0.8)
        guess = f"; did you mean {close[0]!r}?" if close else ""
        return f"{detail}; names must be Hugging Face names (see model.hf_weight_names()){guess}"

    def missing_weights(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[str]:
        """Names of the model's weights that the staged `pairs` leave unwritten."""
        return self._uncovered([view for view, _ in pairs])

    def _uncovered(self, written: list[torch.Tensor]) -> list[str]:
        """Model weights whose memory no written view covers.

        Compared by memory rather than by name because one checkpoint name can fill many model
        names (fused MoE experts fill every per-expert weight; a tied lm_head is the embedding).
        """
        merged: list[tuple[str, int, int]] = []  # disjoint, sorted
        for device, start, end in sorted(s for s in map(_span, written) if s is not None):
            if merged and merged[-1][0] == device and start <= merged[-1][2]:
                _, start, prev_end = merged.pop()
                end = max(end, prev_end)
            merged.append((device, start, end))
        missing = []
        for name in self.model.hf_weight_names():
            if "/" in name:  # a LoRA adapter's tensor (milepost/lora/routes.py): not a checkpoint's
                continue
            span = _span(self.model.weight_view(name))
            if span is None:
                continue
            i = bisect.bisect_right(merged, (span[0], span[1], sys.maxsize)) - 1
            if i < 0 or merged[i][0] != span[0] or merged[i][2] < span[2]:
                missing.append(name)
        return missing

    @staticmethod
    def _parse_specs(
        names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        if not len(names) == len(dtypes) == len(shapes):
            raise WeightUpdateError(
                f"names, dtypes and shapes must have one entry per tensor; got "
                f"{len(names)}, {len(dtypes)} and {len(shapes)}"
            )
        specs = []
        problems = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            try:
                torch_dtype = parse_dtype(dtype)
            except WeightUpdateError as e:
                problems.append(f"{name}: {e}")
                continue
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                problems.append(f"{name}: shape {list(shape)} is not a list of sizes >= 0")
                continue
            specs.append((str(name), torch_dtype, tuple(int(d) for d in shape)))
        WeightLoader._raise_if(
            problems, "; nothing was received, so re-create the weight group before the next update"
        )
        return specs

    @staticmethod
    def _raise_if(problems: list[str], note: str = "") -> None:
        if not problems:
            return
        listed = problems[:_MAX_LISTED_PROBLEMS]
        more = len(problems) - len(listed)
        lines = [f"weight update refused, no weight was changed{note} ({len(problems)} problems):"]
        lines += [f"  - {p}" for p in listed]
        if more:
            lines.append(f"  ... and {more} more")
        raise WeightUpdateError("\n".join(lines))


def _span(t: torch.Tensor) -> tuple[str, int, int] | None:
    """(device, first byte, one past the last byte) that `t` touches; None for empty tensors."""
    if t.numel() == 0:
        return None
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return str(t.device), t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
