"""Prefix cache over token ids: a radix tree whose edges are KV blocks.

Each node owns one KV block and is keyed by that block's tokens under its parent, so a request
whose prompt extends an earlier sequence reuses every full block the two share. A finished
sequence also leaves its last, partly filled block as a *partial* leaf (key shorter than a block).
Blocks are shared only whole and read-only, so a prefix that ends inside a cached block (partial
or full) is reused by copying: `match_prefix` names the block and how many of its leading tokens
continue the prefix, and the scheduler copies those KV entries into a fresh block of the request
(a device-side copy instead of recomputing them). The tree holds one reference on each block it
stores; a block is evictable when the tree's reference is the only one left and its node is a
leaf. Eviction is least-recently-used.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from milepost.engine.block_pool import BlockPool


_INDEX_FROM = 8  # children past which a node indexes them by their first token


class _Node:
    __slots__ = ("block", "by_first", "children", "key", "last_use", "parent")

    def __init__(self, key: tuple[int, ...], block: int, parent: _Node | None) -> None:
        self.key = key
        self.block = block
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        # Children by their first token, once there are more than _INDEX_FROM: a partial match
        # then scans only these (the root can have thousands of unrelated prompts under it).
        # None below that: most nodes have one child, and the index's dict and list were two
        # more objects each for every full garbage collection to scan.
        self.by_first: dict[int, list[_Node]] | None = None
        self.last_use = 0

    def starting_with(self, token: int) -> list[_Node]:
        """The children whose key starts with `token` (a new list: callers may remove them)."""
        if self.by_first is None:
            return [c for c in self.children.values() if c.key[0] == token]
        return list(self.by_first.get(token, ()))


@dataclass
class PrefixMatch:
    """What the cache holds of a prefix: whole blocks to share, then optionally the first
    `partial_len` tokens of `partial_block`, which must be copied (never shared: the request
    writes the rest of its block)."""

    blocks: list[int] = field(default_factory=list)
    partial_block: int = -1
    partial_len: int = 0


class RadixCache:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._root = _Node((), -1, None)
        self._clock = itertools.count(1)
        self.num_cached_blocks = 0

    def match(self, tokens: Sequence[int]) -> list[int]:
        """Blocks of the longest cached full-block prefix of `tokens` (no references taken)."""
        return self.match_prefix(tokens, len(tokens), partial=False).blocks

    def match_prefix(self, tokens: Sequence[int], limit: int, partial: bool = True) -> PrefixMatch:
        """The longest cached prefix of `tokens[:limit]` (no references taken).

        Whole blocks first; with `partial`, where the whole blocks end, the child block whose
        leading tokens continue the prefix furthest (a partial leaf, or a full block the prefix
        leaves inside, or one cut short by `limit`).
        """
        bs, node, now = self.block_size, self._root, next(self._clock)
        found = PrefixMatch()
        pos = 0
        while pos + bs <= limit:
            child = node.children.get(tuple(tokens[pos : pos + bs]))
            if child is None:
                break
            child.last_use = now
            found.blocks.append(child.block)
            node, pos = child, pos + bs
        if partial and pos < limit:
            want = tokens[pos : min(pos + bs, limit)]
            best, best_len = None, 0
            for child in node.starting_with(want[0]):
                n = _common_prefix_len(child.key, want)
                if n > best_len:
                    best, best_len = child, n
            if best is not None:
                best.last_use = now
                found.partial_block, found.partial_len = best.block, best_len
        return found

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], keep_partial: bool = False) -> None:
        """Record that `blocks` hold the KV of `tokens`: every full block, and with `keep_partial`
        the last, partly filled one too. Pass `keep_partial` only for a block its owner no longer
        writes: an owner still appending would later add its full node on the same block.

        Where the tree already has a block for the same tokens, it keeps its own and the caller's
        duplicate stays with the caller (it is freed when the caller lets go of it).
        """
        bs, node, now = self.block_size, self._root, next(self._clock)
        n_full = min(len(tokens) // bs, len(blocks))
        for i in range(n_full):
            node = self._child(node, tuple(tokens[i * bs : (i + 1) * bs]), blocks[i], now)
        tail = tuple(tokens[n_full * bs :])
        # A sibling that already starts with the tail's tokens serves every match it would.
        if (keep_partial and 0 < len(tail) < bs and n_full < len(blocks)
                and not any(c.key[: len(tail)] == tail for c in node.starting_with(tail[0]))):
            self._child(node, tail, blocks[n_full], now)

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
        """Drop the whole tree (e.g. after a weight update); blocks running requests hold survive.

        Each node's link to its parent is cut on the way: a child and its parent's children dict
        refer to each other, so a dropped tree was a cycle that only Python's full garbage
        collection freed, mid-rollout after every weight update (132k objects in one 312 ms
        collection in a CPU run of `milepost bench engine`). Cut, the tree is freed right here."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            node.parent = None
            stack.extend(node.children.values())
            self.pool.decref([node.block])
        self._root.children.clear()
        self._root.by_first = None
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

    def _child(self, node: _Node, key: tuple[int, ...], block: int, now: int) -> _Node:
        """node's child for `key`, added on `block` (one tree reference) if it is new."""
        child = node.children.get(key)
        if child is None:
            # Partial leaves this key starts with are superseded: drop those only the tree holds.
            for old in node.starting_with(key[0]):
                if len(old.key) < len(key) and key[: len(old.key)] == old.key and self._evictable(old):
                    self._remove(old)
            child = _Node(key, block, node)
            node.children[key] = child
            if node.by_first is not None:
                node.by_first.setdefault(key[0], []).append(child)
            elif len(node.children) > _INDEX_FROM:
                node.by_first = {}
                for c in node.children.values():
                    node.by_first.setdefault(c.key[0], []).append(c)
            self.pool.incref([block])
            self.num_cached_blocks += 1
        child.last_use = now
        return child

    def _remove(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        if parent.by_first is not None:
            siblings = parent.by_first[node.key[0]]
            siblings.remove(node)
            if not siblings:
                del parent.by_first[node.key[0]]
        self.pool.decref([node.block])
        self.num_cached_blocks -= 1


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
