"""The tensor codec's allow-list: what our serializer writes decodes (CPU tensors by value; a CUDA
IPC entry reaches torch's rebuild with its classes pinned), and anything else is refused before
any of it runs."""

from __future__ import annotations

import base64
import pickle

import pytest
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from milepost.weights.codec import (
    WeightUpdateError,
    deserialize_named_tensors,
    serialize_named_tensors,
)


class _CudaEntry:
    """Pickles as the CUDA IPC entry torch's reduce_tensor writes (the handle is fake)."""

    def __init__(self, tensor_cls: type, storage_cls: type) -> None:
        self.classes = tensor_cls, storage_cls

    def __reduce__(self) -> tuple:
        tensor_cls, storage_cls = self.classes
        return (rebuild_cuda_tensor, (tensor_cls, torch.Size([2]), (1,), 0, storage_cls,
                                      torch.float32, 0, b"handle", 8, 0, False, b"ref", 0,
                                      b"event", False))


def _b64(obj: object) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.bool, torch.complex64])
def test_our_cpu_payloads_decode(dtype: torch.dtype) -> None:
    t = torch.randn(3, 5).to(dtype)
    [(name, back)] = deserialize_named_tensors(serialize_named_tensors([("w", t[:, 1:])]))
    assert name == "w" and back.dtype == dtype and torch.equal(back.float(), t[:, 1:].float())


def test_a_cuda_ipc_entry_passes_the_allow_list() -> None:
    # It gets as far as opening the (fake) handle: refused by CUDA, not by the allow-list.
    with pytest.raises(WeightUpdateError) as err:
        deserialize_named_tensors(_b64([("w", _CudaEntry(torch.Tensor, torch.storage.TypedStorage))]))
    assert "not a readable pickle" in str(err.value) and "refused" not in str(err.value)


@pytest.mark.parametrize("payload", [
    [("w", _CudaEntry(dict, torch.storage.TypedStorage))],   # a class that is not a tensor
    [("w", _CudaEntry(torch.Tensor, torch.Tensor))],         # a storage class that is not one
    [("w", print)],                                          # any other global
    [("w", pickle.loads)],
])
def test_anything_else_is_refused(payload: object) -> None:
    with pytest.raises(WeightUpdateError, match="refused"):
        deserialize_named_tensors(_b64(payload))
