"""Fixed-size KV blocks with reference counts.

A block holds `block_size` token slots in every layer's KV tensor. A block is shared by every
request (and the prefix cache) that holds a reference; it returns to the free list when the last
reference goes. Block ids index the KV tensors directly: slot = block * block_size + offset.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block; got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with one reference each, or None (and nothing taken) if too few are free."""
        if n > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise RuntimeError(f"incref of free block {b}")
            self._refs[b] += 1

    def decref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise RuntimeError(f"decref of free block {b}")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
