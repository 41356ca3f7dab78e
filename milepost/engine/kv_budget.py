"""How many bytes the KV pool gets on a GPU: SGLang's meaning of --mem-fraction-static.

`mem_fraction_static` is the fraction of the device's TOTAL memory that the engine's static
allocations (weights + KV pool) may reach; the rest, `(1 - fraction) * total`, stays free for
activations, CUDA graphs, the sampler and anything else on the device (a colocated trainer).
Measured after the weights are loaded, as SGLang does: KV bytes = free now - (1 - fraction) *
total. Memory that other processes hold is therefore not counted twice. On CPU the pool keeps
its explicit size (--cpu-kv-cache-gb or --max-total-tokens).
"""

from __future__ import annotations

_GIB = 2**30


def cuda_kv_budget_bytes(total_bytes: int, free_bytes: int, mem_fraction_static: float,
                         weight_bytes: int) -> int:
    """KV pool bytes from the device's total and currently free memory (weights already loaded).

    Raises ValueError naming --mem-fraction-static when nothing is left for the pool.
    """
    reserve = int(total_bytes * (1.0 - mem_fraction_static))
    budget = free_bytes - reserve
    if budget <= 0:
        need = 1.0 - free_bytes / total_bytes  # the fraction at which the budget turns positive
        raise ValueError(
            f"no GPU memory left for the KV pool: the device has {total_bytes / _GIB:.1f} GiB, "
            f"{free_bytes / _GIB:.1f} GiB free after loading {weight_bytes / _GIB:.2f} GiB of "
            f"weights, and --mem-fraction-static {mem_fraction_static} keeps "
            f"{reserve / _GIB:.1f} GiB free for activations and other processes; raise "
            f"--mem-fraction-static above {need:.2f} (weights + KV may use that share of the "
            "device) or free GPU memory held by other processes"
        )
    return budget


def out_of_memory_message(what: str, nbytes: int | None, mem_fraction_static: float) -> str:
    """The start-up error when allocating `what` (weights or the KV pool) runs out of memory."""
    size = f" ({nbytes / _GIB:.2f} GiB)" if nbytes is not None else ""
    return (
        f"CUDA out of memory allocating {what}{size} at start: "
        f"--mem-fraction-static is {mem_fraction_static} (weights + KV pool may use that share of "
        "the device's total memory); lower it, or pass a smaller --max-total-tokens, or free GPU "
        "memory held by other processes"
    )
