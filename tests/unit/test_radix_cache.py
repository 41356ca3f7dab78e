"""RadixCache: block-granular prefix matching, sharing, LRU eviction, reset, duplicate inserts."""

from __future__ import annotations

import pytest

from milepost.engine.block_pool import BlockPool
from milepost.engine.radix_cache import PrefixMatch, RadixCache

BS = 4


def _setup(num_blocks: int = 32) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(num_blocks)
    return pool, RadixCache(pool, BS)


def _compute(pool: BlockPool, n_tokens: int) -> list[int]:
    """Blocks a request would allocate to hold n_tokens of KV."""
    blocks = pool.allocate(-(-n_tokens // BS))
    assert blocks is not None
    return blocks


def test_match_and_insert_are_block_granular() -> None:
    pool, cache = _setup()
    tokens = list(range(10))  # two full blocks and a partial one
    blocks = _compute(pool, 10)
    cache.insert(tokens, blocks)
    assert cache.num_cached_blocks == 2, "the partial trailing block must not be cached"
    assert [pool.refcount(b) for b in blocks] == [2, 2, 1]
    assert sorted(cache.held_blocks()) == sorted(blocks[:2])

    assert cache.match(tokens) == blocks[:2]
    assert cache.match(tokens + [99, 98, 97]) == blocks[:2]
    assert cache.match(tokens[:7]) == blocks[:1], "7 tokens cover only one full block"
    assert cache.match(tokens[:3]) == []
    assert cache.match([0, 1, 2, 3, 4, 5, 6, 99]) == blocks[:1], "mismatch inside block 2"
    assert cache.match([7] + tokens[1:]) == []
    # match takes no references
    assert [pool.refcount(b) for b in blocks] == [2, 2, 1]


def test_diverging_sequences_share_their_common_prefix() -> None:
    pool, cache = _setup()
    prefix = list(range(8))
    seq_a, seq_b = prefix + [100, 101, 102, 103], prefix + [200, 201, 202, 203]
    blocks_a = _compute(pool, 12)
    cache.insert(seq_a, blocks_a)

    shared = cache.match(seq_b)
    assert shared == blocks_a[:2]
    pool.incref(shared)  # what the scheduler does on admission
    blocks_b = shared + _compute(pool, 4)
    cache.insert(seq_b, blocks_b)

    assert cache.num_cached_blocks == 4, "2 shared + one leaf per branch"
    assert cache.match(seq_a) == blocks_a and cache.match(seq_b) == blocks_b
    assert cache.match(prefix + [100, 101, 102, 0]) == blocks_a[:2]
    # the shared prefix is held by both requests and the tree
    assert [pool.refcount(b) for b in shared] == [3, 3]
    assert pool.num_used == 4


def test_eviction_is_least_recently_used() -> None:
    pool, cache = _setup()
    seqs = {name: [base + i for i in range(BS)] for name, base in (("a", 0), ("b", 10), ("c", 20))}
    held = {}
    for name, toks in seqs.items():  # inserted in order a, b, c
        held[name] = _compute(pool, BS)
        cache.insert(toks, held[name])
        pool.decref(held[name])  # the request finishes: only the cache holds it
    assert cache.num_evictable() == 3
    cache.match(seqs["a"])  # a is now the most recent

    assert cache.evict(1) == 1
    assert cache.match(seqs["b"]) == [] and pool.refcount(held["b"][0]) == 0
    assert cache.evict(1) == 1
    assert cache.match(seqs["c"]) == []
    assert cache.match(seqs["a"]) == held["a"]
    assert cache.evict(5) == 1
    assert pool.num_free == pool.num_blocks and cache.num_cached_blocks == 0


def test_eviction_never_frees_a_block_a_request_holds() -> None:
    pool, cache = _setup()
    tokens = list(range(8))
    blocks = _compute(pool, 8)
    cache.insert(tokens, blocks)  # the request keeps its references
    assert cache.num_evictable() == 0
    assert cache.evict(10) == 0
    assert [pool.refcount(b) for b in blocks] == [2, 2]
    assert cache.match(tokens) == blocks


def test_parents_become_evictable_after_their_children() -> None:
    pool, cache = _setup()
    prefix = list(range(4))
    child_1, child_2 = prefix + [10, 11, 12, 13], prefix + [20, 21, 22, 23]
    b1 = _compute(pool, 8)
    cache.insert(child_1, b1)
    shared = cache.match(child_2)
    pool.incref(shared)
    b2 = shared + _compute(pool, 4)
    cache.insert(child_2, b2)
    pool.decref(b2)  # request 2 finished; request 1 still holds prefix + child_1

    # only child_2's leaf: the parent is held by request 1 (and has a held child)
    assert cache.num_evictable() == 1
    assert cache.evict(10) == 1
    assert cache.match(child_2) == shared
    assert cache.match(child_1) == b1

    pool.decref(b1)  # request 1 finishes
    assert cache.num_evictable() == 2
    assert cache.evict(1) == 1, "the leaf goes first"
    assert cache.match(child_1) == b1[:1]
    assert cache.evict(10) == 1, "then its parent"
    assert pool.num_free == pool.num_blocks and cache.num_cached_blocks == 0


def test_held_child_keeps_its_free_parent() -> None:
    pool, cache = _setup()
    tokens = list(range(8))
    blocks = _compute(pool, 8)
    cache.insert(tokens, blocks)
    pool.decref(blocks[:1])  # the request lets go of the parent, keeps the child
    assert cache.num_evictable() == 0
    assert cache.evict(5) == 0
    assert pool.refcount(blocks[0]) == 1


def test_num_evictable_counts_only_freeable_subtrees() -> None:
    pool, cache = _setup()
    a = list(range(12))
    b = list(range(8)) + [50, 51, 52, 53]
    blocks_a = _compute(pool, 12)
    cache.insert(a, blocks_a)
    shared = cache.match(b)
    pool.incref(shared)
    blocks_b = shared + _compute(pool, 4)
    cache.insert(b, blocks_b)
    pool.decref(blocks_a)
    assert cache.num_evictable() == 1  # only a's leaf; b holds the prefix and its own leaf
    pool.decref(blocks_b)
    assert cache.num_evictable() == 4
    assert cache.evict(100) == 4


def test_num_evictable_and_eviction_on_a_deep_tree() -> None:
    # page size 1 and a long sequence: the tree is thousands of nodes deep
    pool = BlockPool(5000)
    cache = RadixCache(pool, 1)
    tokens = list(range(5000))
    blocks = pool.allocate(5000)
    assert blocks is not None
    cache.insert(tokens, blocks)
    pool.decref(blocks)
    assert cache.num_evictable() == 5000
    assert cache.evict(5000) == 5000
    assert pool.num_free == 5000


def test_reset_keeps_blocks_requests_hold() -> None:
    pool, cache = _setup()
    tokens = list(range(12))
    blocks = _compute(pool, 12)
    cache.insert(tokens, blocks)
    pool.decref(blocks[1:])  # the request holds only the first block now
    cache.reset()
    assert cache.num_cached_blocks == 0 and cache.held_blocks() == []
    assert cache.match(tokens) == []
    assert pool.refcount(blocks[0]) == 1
    assert pool.refcount(blocks[1]) == 0 and pool.refcount(blocks[2]) == 0
    assert pool.num_used == 1
    # the tree works again after a reset
    cache.insert(tokens[:4], blocks[:1])
    assert cache.match(tokens) == blocks[:1]


def test_duplicate_insert_keeps_the_trees_block() -> None:
    pool, cache = _setup()
    tokens = list(range(10))
    first = _compute(pool, 10)
    cache.insert(tokens, first)
    second = _compute(pool, 10)  # computed concurrently, before the first was cached
    cache.insert(tokens, second)
    assert cache.num_cached_blocks == 2
    assert cache.match(tokens) == first[:2]
    assert [pool.refcount(b) for b in second] == [1, 1, 1], "the tree took no reference"

    free_before = pool.num_free
    pool.decref(second)  # the duplicate request finishes: all its blocks go back
    assert pool.num_free == free_before + 3
    pool.decref(first)
    assert pool.num_used == 2 and cache.num_evictable() == 2


def test_duplicate_prefix_with_new_suffix_extends_the_trees_path() -> None:
    pool, cache = _setup()
    first = _compute(pool, 4)
    cache.insert(list(range(4)), first)
    longer = list(range(8))
    mine = _compute(pool, 8)  # its own copy of block 0, plus block 1
    cache.insert(longer, mine)
    assert cache.match(longer) == [first[0], mine[1]]
    assert pool.refcount(mine[0]) == 1 and pool.refcount(mine[1]) == 2
    pool.decref(mine)
    pool.decref(first)
    assert pool.num_used == 2
    assert cache.evict(2) == 2 and pool.num_used == 0


def test_partial_leaf_is_kept_only_when_asked_and_matched_by_prefix() -> None:
    pool, cache = _setup()
    tokens = list(range(10))  # two full blocks + 2 tokens in a third
    blocks = _compute(pool, 10)
    cache.insert(tokens, blocks)
    assert cache.num_cached_blocks == 2
    cache.insert(tokens, blocks, keep_partial=True)
    assert cache.num_cached_blocks == 3 and pool.refcount(blocks[2]) == 2

    found = cache.match_prefix(tokens + [50, 51], limit=11)
    assert (found.blocks, found.partial_block, found.partial_len) == (blocks[:2], blocks[2], 2)
    # the limit cuts the copied part; a mismatch inside the tail cuts it too
    assert cache.match_prefix(tokens, limit=9).partial_len == 1
    assert cache.match_prefix(tokens[:8] + [8, 77], limit=10).partial_len == 1
    assert cache.match_prefix(tokens[:8] + [77], limit=9).partial_len == 0
    assert cache.match_prefix(tokens, limit=10, partial=False).partial_len == 0
    assert cache.match(tokens + [50]) == blocks[:2], "match stays whole-block"


def test_prefix_ending_inside_a_full_block_is_matched_partially() -> None:
    pool, cache = _setup()
    tokens = list(range(8))
    blocks = _compute(pool, 8)
    cache.insert(tokens, blocks)
    found = cache.match_prefix(tokens, limit=7)  # a full hit must still compute one token
    assert (found.blocks, found.partial_block, found.partial_len) == (blocks[:1], blocks[1], 3)
    found = cache.match_prefix([0, 1, 2, 3, 4, 5, 99, 99], limit=8)
    assert (found.partial_block, found.partial_len) == (blocks[1], 2)


def test_full_block_supersedes_partial_leaf_only_the_tree_holds() -> None:
    pool, cache = _setup()
    first = _compute(pool, 6)  # [full, partial(2)]
    cache.insert(list(range(6)), first, keep_partial=True)
    pool.decref(first)  # the request is gone: the partial leaf is cache-only
    longer = first[:1] + _compute(pool, 4)
    pool.incref(first[:1])
    cache.insert(list(range(8)), longer)  # the next turn fills a whole block with the same start
    assert sorted(cache.held_blocks()) == sorted(longer)
    assert pool.refcount(first[1]) == 0, "the superseded partial block returned to the pool"
    # a shorter partial under a sibling that already covers it is not added
    extra = _compute(pool, 6)
    cache.insert(list(range(6)), extra, keep_partial=True)
    assert sorted(cache.held_blocks()) == sorted(longer)
    assert cache.match_prefix(list(range(7)), limit=6).partial_block == longer[1]


def test_partial_leaves_are_evicted_like_any_leaf() -> None:
    pool, cache = _setup()
    for base in (0, 100):
        blocks = _compute(pool, 6)
        cache.insert([base + i for i in range(6)], blocks, keep_partial=True)
        pool.decref(blocks)
    assert cache.num_evictable() == 4
    assert cache.evict(10) == 4 and pool.num_free == pool.num_blocks
    assert cache.match_prefix(list(range(6)), limit=5).partial_len == 0


def test_a_reset_tree_is_freed_without_the_garbage_collector() -> None:
    # A child and its parent's children dict refer to each other: a dropped tree was a cycle that
    # only a full collection freed, mid-rollout after every weight update (132k objects in one
    # 312 ms collection in a CPU run of `milepost bench engine`).
    import gc

    from milepost.engine.radix_cache import _Node

    pool, cache = _setup(64)
    for start in (0, 100, 200):  # three branches of shared and private blocks
        tokens = [1, 2, 3, 4] + list(range(start, start + 20))
        cache.insert(tokens, _compute(pool, len(tokens)))
    assert cache.num_cached_blocks > 10
    nodes, stack = set(), list(cache._root.children.values())
    while stack:  # this tree's nodes by id (references would keep them alive)
        node = stack.pop()
        nodes.add(id(node))
        stack.extend(node.children.values())
    del node
    gc.collect()
    gc.disable()  # cyclic garbage would stay alive until the next collection
    try:
        cache.reset()
        alive = [o for o in gc.get_objects() if isinstance(o, _Node) and id(o) in nodes]
    finally:
        gc.enable()
    assert len(nodes) > 10 and alive == []


@pytest.mark.parametrize("siblings", [3, 20])  # below and past the first-token index (_INDEX_FROM)
def test_many_or_few_children_match_partially_and_evict_alike(siblings: int) -> None:
    pool, cache = _setup(128)
    prompts = []
    for i in range(siblings):  # children of the root: first tokens shared in pairs
        tokens = [i // 2, 1000 + i, 7, 7, 9, 9]  # one full block and a partial leaf of 2 tokens
        blocks = _compute(pool, len(tokens))
        cache.insert(tokens, blocks, keep_partial=True)
        pool.decref(blocks)  # only the tree holds them now
        prompts.append(tokens)
    for tokens in prompts:
        found = cache.match_prefix(tokens[:3], limit=3)
        assert found.blocks == [] and found.partial_len == 3  # inside its own block, not a sibling
        assert cache.match_prefix(tokens, limit=6).partial_len == 2  # the partial leaf
    assert cache.evict(2 * siblings) == 2 * siblings and cache.num_cached_blocks == 0
    assert cache.match_prefix(prompts[0], limit=6) == PrefixMatch()
    # the tree works again after every child is gone
    blocks = _compute(pool, 4)
    cache.insert(prompts[1][:4], blocks)
    assert cache.match(prompts[1]) == blocks
