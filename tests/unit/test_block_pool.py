"""BlockPool: all-or-nothing allocation, reference counts, errors on misuse."""

from __future__ import annotations

import pytest

from milepost.engine.block_pool import BlockPool


def test_allocate_is_all_or_nothing() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert a is not None and len(set(a)) == 3
    assert pool.num_free == 1 and pool.num_used == 3
    assert pool.allocate(2) is None
    assert pool.num_free == 1, "a failed allocation must take nothing"
    b = pool.allocate(1)
    assert b is not None and b[0] not in a
    assert pool.allocate(1) is None
    assert pool.allocate(0) == []


def test_fresh_blocks_have_one_reference() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    assert blocks is not None
    assert [pool.refcount(b) for b in blocks] == [1, 1, 1]


def test_block_is_freed_on_last_decref_only() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1) or []
    pool.incref([b])
    pool.incref([b])
    assert pool.refcount(b) == 3
    pool.decref([b])
    pool.decref([b])
    assert pool.refcount(b) == 1 and pool.num_free == 1
    pool.decref([b])
    assert pool.refcount(b) == 0 and pool.num_free == 2
    again = pool.allocate(2)
    assert again is not None and sorted(again) == [0, 1]


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1) or []
    pool.decref([b])
    with pytest.raises(RuntimeError, match="free block"):
        pool.decref([b])
    assert pool.num_free == 2, "a refused decref must not put the block on the free list twice"


def test_incref_of_free_block_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="free block"):
        pool.incref([1])
    assert pool.refcount(1) == 0 and pool.num_free == 2


def test_pool_needs_a_block() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)
