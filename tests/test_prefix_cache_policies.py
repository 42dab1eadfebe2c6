"""Eviction policies of the prefix cache, and id-keyed pages (engine/eviction.py, docs/design.md §3)."""

from __future__ import annotations

import pytest

import engine as dl
from engine.block_manager import BlockManager, Session
from engine.prefix_cache import PrefixCache

from .prefix_helpers import evaluated, make_pool, teardown


def cached(cache: PrefixCache, pool, tokens) -> None:
    """Evaluate `tokens` in a session, donate its full pages, release it."""
    s = evaluated(pool, tokens)
    dl.prefix_insert(cache, pool, s, tokens)
    s.release()


def matched(cache: PrefixCache, pool, prompt) -> int:
    s = Session(pool)
    n = dl.prefix_attach(cache, pool, s, prompt)
    s.release()
    return n


def test_plain_lru_strands_descendants_until_the_head_returns():
    pool = make_pool(page_rows=2)
    cache = dl.create_prefix_cache(max_pages=3, policy="lru")
    cached(cache, pool, [1, 2, 3, 4, 5, 6])   # pages A-B-C, A the least recently used
    cached(cache, pool, [9, 9])               # over budget: plain LRU drops A, the head
    heads = {e.tokens for e in cache.pages.values()}
    assert heads == {(3, 4), (5, 6), (9, 9)}  # B and C stay, counted against the budget
    assert matched(cache, pool, [1, 2, 3, 4, 5, 6, 7]) == 0  # ... but cannot be reached
    cache.max_pages = 4                       # room for A again (else B, now the LRU, goes)
    cached(cache, pool, [1, 2])               # A again: B and C are reachable again
    assert matched(cache, pool, [1, 2, 3, 4, 5, 6, 7]) == 6
    pool.check()
    teardown([], cache, pool)


def test_leaf_lru_drops_the_deepest_page_first():
    pool = make_pool(page_rows=2)
    cache = dl.create_prefix_cache(max_pages=3)
    cached(cache, pool, [1, 2, 3, 4, 5, 6])
    cached(cache, pool, [9, 9])
    assert {e.tokens for e in cache.pages.values()} == {(1, 2), (3, 4), (9, 9)}
    assert matched(cache, pool, [1, 2, 3, 4, 5, 6, 7]) == 4
    teardown([], cache, pool)


@pytest.mark.parametrize("policy, kept", [("leaf-lru", (1, 1)), ("fifo", (2, 2)), ("lfu", (1, 1))])
def test_which_leaf_goes(policy, kept):
    # (1,1) is inserted first and hit twice; (2,2) comes later; (3,3) needs room in a budget of 2.
    pool = make_pool(page_rows=2)
    cache = dl.create_prefix_cache(max_pages=2, policy=policy)
    cached(cache, pool, [1, 1])
    cached(cache, pool, [2, 2])
    assert matched(cache, pool, [1, 1, 0]) == 2
    assert matched(cache, pool, [1, 1, 0]) == 2
    cached(cache, pool, [3, 3])
    assert {e.tokens for e in cache.pages.values()} == {kept, (3, 3)}
    teardown([], cache, pool)


def test_id_keyed_pages_store_no_tokens_and_need_one_id_per_page():
    pages = BlockManager(page_rows=1)
    cache = PrefixCache(id_keys=True)
    ids = [70, 71, 72]
    s = Session(pages)
    assert dl.prefix_attach(cache, pages, s, ids) == 0
    pages.allocate([s], [3])
    pages.commit([s], [ids])
    assert dl.prefix_insert(cache, pages, s, ids[:2]) == 2
    s.release()
    assert set(cache.pages) == {70, 71} and cache.pages[71].parent == 70
    assert all(e.tokens == () for e in cache.pages.values()) and cache.siblings == {}  # no tokens kept
    s = Session(pages)
    assert dl.prefix_attach(cache, pages, s, [70, 71, 99]) == 2  # capped one short of three ids
    s.release()
    dl.prefix_release(cache, pages)
    pages.check()
    with pytest.raises(ValueError, match="one id per page"):
        PrefixCache(id_keys=True).bind(BlockManager(page_rows=16))


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'; one of leaf-lru, lru, lfu, fifo"):
        dl.create_prefix_cache(policy="mru")
