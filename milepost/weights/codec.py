"""The wire format of SGLang's `/update_weights_from_tensor`: base64 of a pickled [(name, tensor)].

CPU tensors travel by value (plain pickle) so any process can read them; CUDA tensors travel as
CUDA IPC handles (torch's multiprocessing reduction, as SGLang's ForkingPickler does), so the
receiver must sit on the same host and the sender must keep them alive until the update returns.
Decoding does not trust the payload: it unpickles with an allow-list (`_TensorOnlyUnpickler`)
that knows only what `serialize_named_tensors` writes (tensor rebuilds, dtypes, sizes), and reads
tensor bytes with torch's weights-only loader, so a crafted payload cannot run code in the engine
(SGLang itself unpickles whatever arrives; its sender format is unchanged here).
"""

from __future__ import annotations

import base64
import binascii
import collections
import io
import pickle

import torch
from torch.multiprocessing import reductions as _mp_reductions
from torch.multiprocessing.reductions import reduce_tensor


class WeightUpdateError(ValueError):
    """A weight update was refused (bad payload, unknown names, shape/dtype mismatch, ...).

    Raised before any weight changes, except where a docstring says otherwise; the message names
    every offending input so the sender can fix it in one go.
    """


class _CudaByHandlePickler(pickle.Pickler):
    """Plain pickle, except CUDA tensors become CUDA IPC handles.

    Pickling a whole list with ForkingPickler would also move CPU tensors into shared memory
    passed by file descriptor, which only a child of this process can open; this pickler sends
    CPU tensors by value and uses torch's IPC reduction only where bytes cannot travel cheaply.
    """

    def reducer_override(self, obj: object) -> object:
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            return reduce_tensor(obj)
        return NotImplemented


def _wire_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"serialize_named_tensors: {name!r} is a {type(tensor).__name__}, not a tensor")
    if tensor.is_meta:
        raise ValueError(f"serialize_named_tensors: {name!r} is a meta tensor and holds no data")
    tensor = tensor.detach()
    if tensor.is_cuda:
        return tensor  # the IPC handle names the storage; the receiver rebuilds the same view
    # Pickle sends a tensor's whole storage: a slice of a big buffer would ship the big buffer.
    covers_storage = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    if not tensor.is_contiguous() or not covers_storage:
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """Encode [(hf_name, tensor)] as one entry of SGLang's `serialized_named_tensors` list.

    The result is readable by SGLang's receiver (`ForkingPickler.loads(b64decode(s))`) and by
    `deserialize_named_tensors`. Gradients are dropped; CPU views are compacted before sending.
    """
    payload = [(str(name), _wire_tensor(name, tensor)) for name, tensor in named]
    buf = io.BytesIO()
    _CudaByHandlePickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(payload)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(data: str) -> list[tuple[str, torch.Tensor]]:
    """Decode one `serialized_named_tensors` entry into [(hf_name, tensor)].

    Raises WeightUpdateError for anything that is not base64 of a pickled list of
    (str, Tensor) pairs, including any pickle that names a global outside the allow-list.
    """
    if not isinstance(data, str):
        raise WeightUpdateError(
            f"serialized_named_tensors entry must be a base64 string, got {type(data).__name__}"
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise WeightUpdateError(
            f"serialized_named_tensors entry is not valid base64 ({e}); "
            "encode with milepost.weights.codec.serialize_named_tensors"
        ) from e
    try:
        obj = _TensorOnlyUnpickler(io.BytesIO(raw)).load()
    except _Forbidden as e:
        raise WeightUpdateError(
            f"serialized_named_tensors entry refused: {e}; only (name, tensor) lists written by "
            "milepost.weights.codec.serialize_named_tensors are accepted"
        ) from e
    except Exception as e:  # unpickling can fail in any way a payload chooses
        raise WeightUpdateError(
            f"serialized_named_tensors entry is base64 but not a readable pickle "
            f"({type(e).__name__}: {e}); payloads with CUDA tensors decode only on the sender's host"
        ) from e
    return _check_structure(obj)


class _Forbidden(pickle.UnpicklingError):
    """The payload names a global the allow-list does not hold (a code-execution attempt or a
    format this engine does not read)."""


def _storage_from_bytes(data: bytes) -> object:
    """Stands in for `torch.storage._load_from_bytes` (which calls torch.load with
    weights_only=False): the same bytes, read by torch's weights-only unpickler."""
    if not isinstance(data, (bytes, bytearray)):
        raise _Forbidden(f"tensor storage must be bytes, got {type(data).__name__}")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as e:
        raise _Forbidden("tensor bytes hold more than a storage (torch's weights-only loader "
                         "refused them)") from e


def _rebuild_cuda_tensor(tensor_cls: object, *args: object) -> torch.Tensor:
    """`rebuild_cuda_tensor` with its class arguments pinned to the ones a tensor reduces to."""
    storage_cls = args[3] if len(args) > 3 else None
    if tensor_cls not in (torch.Tensor, torch.nn.Parameter) or storage_cls not in (
        torch.storage.TypedStorage, torch.storage.UntypedStorage
    ):
        raise _Forbidden("a CUDA tensor entry names classes other than Tensor and its storage")
    return _mp_reductions.rebuild_cuda_tensor(tensor_cls, *args)


# Exactly what pickling [(str, Tensor)] writes: CPU tensors by value, CUDA tensors by IPC handle.
_ALLOWED: dict[tuple[str, str], object] = {
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    # float8 / uint16+: written by pickle, though torch cannot read those back yet
    ("torch._utils", "_rebuild_tensor_v3"): torch._utils._rebuild_tensor_v3,
    ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "Size"): torch.Size,
    ("torch", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
    ("torch.storage", "UntypedStorage"): torch.storage.UntypedStorage,
}


class _TensorOnlyUnpickler(pickle.Unpickler):
    """Resolves only the allow-listed globals and torch dtypes; anything else is refused."""

    def find_class(self, module: str, name: str) -> object:
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Forbidden(f"the pickle names {module}.{name}, which is not a tensor part")

    def persistent_load(self, pid: object) -> object:
        raise _Forbidden("the pickle uses persistent ids (a torch.save file, not this format)")


def _check_structure(obj: object) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(obj, (list, tuple)):
        raise WeightUpdateError(
            f"serialized_named_tensors entry must decode to a list of (name, tensor) pairs, "
            f"got {type(obj).__name__}"
        )
    named: list[tuple[str, torch.Tensor]] = []
    for i, item in enumerate(obj):
        if (
            not isinstance(item, (list, tuple))
            or len(item) != 2
            or not isinstance(item[0], str)
            or not isinstance(item[1], torch.Tensor)
        ):
            shown = type(item).__name__
            if isinstance(item, (list, tuple)):
                shown = f"({', '.join(type(x).__name__ for x in item)})"
            raise WeightUpdateError(
                f"serialized_named_tensors item {i} must be a (str, Tensor) pair, got {shown}"
            )
        named.append((item[0], item[1]))
    return named
