"""Prefix cache over token ids at block granularity (a radix tree whose edges are full blocks).

Each node owns one full KV block and is keyed by that block's tokens under its parent, so a
request whose prompt extends an earlier sequence reuses every full block the two share. The tree
holds one reference on each block it stores; a block is evictable when the tree's reference is
the only one left and its node is a leaf. Eviction is least-recently-used.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from milepost.engine.block_pool import BlockPool


class _Node:
    __slots__ = ("key", "block", "parent", "children", "last_use")

    def __init__(self, key: tuple[int, ...], block: int, parent: _Node | None) -> None:
        self.key = key
        self.block = block
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_use = 0


class RadixCache:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._root = _Node((), -1, None)
        self._clock = itertools.count(1)
        self.num_cached_blocks = 0

    def match(self, tokens: Sequence[int]) -> list[int]:
        """Blocks of the longest cached full-block prefix of `tokens` (no references taken)."""
        node, blocks, now = self._root, [], next(self._clock)
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            child = node.children.get(tuple(tokens[start : start + self.block_size]))
            if child is None:
                break
            child.last_use = now
            blocks.append(child.block)
            node = child
        return blocks

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> None:
        """Record that `blocks` hold the KV of `tokens` (only the full blocks are cached).

        Where the tree already has a block for the same tokens, it keeps its own and the caller's
        duplicate stays with the caller (it is freed when the caller lets go of it).
        """
        node, now = self._root, next(self._clock)
        n_full = min(len(tokens) // self.block_size, len(blocks))
        for i in range(n_full):
            key = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            child = node.children.get(key)
            if child is None:
                child = _Node(key, blocks[i], node)
                node.children[key] = child
                self.pool.incref([blocks[i]])
                self.num_cached_blocks += 1
            child.last_use = now
            node = child

    def evict(self, n_blocks: int) -> int:
        """Free up to n_blocks blocks that only the cache holds, oldest first; returns how many."""
        heap = [(n.last_use, id(n), n) for n in self._leaves() if self._evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < n_blocks:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._remove(node)
            freed += 1
            if parent is not self._root and not parent.children and self._evictable(parent):
                heapq.heappush(heap, (parent.last_use, id(parent), parent))
        return freed

    def num_evictable(self) -> int:
        """Blocks eviction could free now: nodes whose whole subtree only the cache holds."""
        # Iterative post-order: the tree is one level per block, so a long sequence with small
        # pages is thousands of levels deep, past Python's recursion limit.
        total = 0
        all_free: dict[int, bool] = {}  # id(node) -> its whole subtree is cache-only
        stack: list[tuple[_Node, bool]] = [(self._root, False)]
        while stack:
            node, children_done = stack.pop()
            if not children_done:
                stack.append((node, True))
                stack.extend((c, False) for c in node.children.values())
                continue
            free = all([all_free.pop(id(c)) for c in node.children.values()])
            if node is not self._root:
                free = free and self.pool.refcount(node.block) == 1
                total += free
            all_free[id(node)] = free
        return total

    def held_blocks(self) -> list[int]:
        """Every block the tree holds a reference on."""
        blocks, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            blocks.append(node.block)
            stack.extend(node.children.values())
        return blocks

    def reset(self) -> None:
        """Drop the whole tree (e.g. after a weight update); blocks running requests hold survive."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            self.pool.decref([node.block])
        self._root.children.clear()
        self.num_cached_blocks = 0

    def _evictable(self, node: _Node) -> bool:
        return not node.children and self.pool.refcount(node.block) == 1

    def _leaves(self) -> list[_Node]:
        leaves, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves

    def _remove(self, node: _Node) -> None:
        assert node.parent is not None
        del node.parent.children[node.key]
        self.pool.decref([node.block])
        self.num_cached_blocks -= 1
