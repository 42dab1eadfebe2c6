"""The cache's promises (issue 10): held counts, snapshots, the budget at release, namespace
isolation under a forced collision, unknown chains, change listeners, and the bare manager."""

from __future__ import annotations

import pytest

import engine as dl
from engine.prefix_cache import blake2b_64

from .prefix_helpers import assert_cache_consistent, evaluated, make_pool, teardown

SYSTEM = list(range(100, 110))  # 10 tokens: 2 full pages of 4, and 2 tokens more


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def attached(cache, pool, prompt, namespace: str = ""):
    s = dl.Session(pool=pool)
    return s, dl.prefix_attach(cache, pool, s, prompt, namespace)


def test_held_groups_counts_pages_and_held_pages_lists_them():
    pool, cache = make_pool(4), dl.create_prefix_cache()
    a = evaluated(pool, SYSTEM)
    assert dl.prefix_held_groups(cache) == 0 and dl.prefix_held_pages(cache) == []
    dl.prefix_insert(cache, pool, a, a.tokens)
    assert dl.prefix_held_groups(cache) == 2
    assert dl.prefix_held_pages(cache) == sorted(a.page_table[:2])
    teardown([a], cache, pool)


def test_budget_holds_right_after_a_release():
    pool, cache = make_pool(4), dl.create_prefix_cache(max_pages=2)
    a = evaluated(pool, seq(0, 17))                        # 4 full pages and one token
    assert dl.prefix_insert(cache, pool, a, a.tokens) == 4
    assert dl.prefix_held_groups(cache) == 4               # a holds them: nothing evictable yet
    pages = a.page_table
    dl.release_kv_pages(a)
    assert dl.prefix_held_groups(cache) <= 2               # now, not at the next insert
    assert dl.prefix_held_pages(cache) == sorted(pages[:2])
    s, n = attached(cache, pool, seq(0, 17))
    assert n == 8                                          # the deepest pages went first
    assert_cache_consistent(cache, pool)
    teardown([s], cache, pool)


def ns_blind(data: bytes) -> int:
    """A hash that ignores the namespace salt: every namespace's root pages collide."""
    if data.startswith(b"ns:"):
        data = data[data.index(b"\0") + 1:]
    return blake2b_64(data)


def test_namespaces_stay_apart_even_when_their_keys_collide():
    pool, cache = make_pool(4), dl.create_prefix_cache(hash_fn=ns_blind)
    a = evaluated(pool, seq(0, 9))
    assert dl.prefix_insert(cache, pool, a, a.tokens, namespace="alice") == 2
    assert cache.page_key(None, seq(0, 4), "bob") == cache.page_key(None, seq(0, 4), "alice")
    s, n = attached(cache, pool, seq(0, 9), namespace="bob")
    assert n == 0 and s.page_table == []                   # the key routes, the namespace refuses
    assert dl.prefix_probe(cache, seq(0, 9), "bob").stop_reason == "token_mismatch"
    b = evaluated(pool, seq(0, 9))
    assert dl.prefix_insert(cache, pool, b, b.tokens, namespace="bob") == 0   # never under alice's key
    t, m = attached(cache, pool, seq(0, 9), namespace="alice")
    assert m == 8 and t.page_table == a.page_table[:2]
    assert_cache_consistent(cache, pool)
    teardown([a, b, s, t], cache, pool)


def test_chain_list_returns_snapshots():
    pool, cache = make_pool(4), dl.create_prefix_cache()
    a = evaluated(pool, SYSTEM)
    dl.prefix_insert(cache, pool, a, a.tokens, "sys")
    [chain] = dl.prefix_chain_list(cache)
    chain.hits, chain.pages_live, chain.preview = 99, 0, "changed"
    [again] = dl.prefix_chain_list(cache)
    assert (again.hits, again.pages_live, again.preview) == (0, 2, "sys")
    s, n = attached(cache, pool, SYSTEM)
    assert n == 8 and chain.hits == 99                     # the old snapshot does not move
    assert dl.prefix_chain_list(cache)[0].hits == 1
    teardown([a, s], cache, pool)


def test_an_unknown_chain_id_is_an_error():
    pool, cache = make_pool(4), dl.create_prefix_cache()
    a = evaluated(pool, SYSTEM)
    dl.prefix_insert(cache, pool, a, SYSTEM[:4], "sys")
    [chain] = dl.prefix_chain_list(cache)
    assert dl.prefix_insert(cache, pool, a, SYSTEM, chain_id=chain.id) == 1   # appends to it
    assert [c.pages_live for c in dl.prefix_chain_list(cache)] == [2]
    with pytest.raises(ValueError, match="chain 12345 does not exist"):
        dl.prefix_insert(cache, pool, a, SYSTEM, chain_id=12345)
    a.release()
    assert cache.evict(2) == 2                             # the chain's pages are gone, and so is it
    b = evaluated(pool, SYSTEM)
    with pytest.raises(ValueError, match=f"chain {chain.id} does not exist"):
        dl.prefix_insert(cache, pool, b, SYSTEM, chain_id=chain.id)
    assert cache.pages == {}                               # a refused insert stores nothing
    teardown([b], cache, pool)


def test_listeners_hear_stored_removed_and_cleared():
    pool, cache = make_pool(4), dl.create_prefix_cache()
    events: list[dl.CacheEvent] = []
    cache.add_listener(events.append)
    a = evaluated(pool, seq(0, 9))
    dl.prefix_insert(cache, pool, a, seq(0, 4), namespace="ns")
    dl.prefix_insert(cache, pool, a, a.tokens, namespace="ns")
    dl.prefix_insert(cache, pool, a, a.tokens, namespace="ns")    # nothing new: no event
    assert [e.kind for e in events] == ["stored", "stored"]
    [root], [child] = events[0].pages, events[1].pages
    assert root == dl.CachedPageInfo(key=root.key, parent=None, tokens=tuple(seq(0, 4)), namespace="ns")
    assert (child.parent, child.tokens, child.namespace) == (root.key, tuple(seq(4, 4)), "ns")
    assert {root.key, child.key} == set(cache.pages)

    b = evaluated(pool, seq(50, 12))
    dl.prefix_insert(cache, pool, b, b.tokens)
    stored = events[-1].pages                                      # one event, root to leaf
    assert [p.tokens for p in stored] == [tuple(seq(50, 4)), tuple(seq(54, 4)), tuple(seq(58, 4))]
    assert [p.parent for p in stored] == [None, stored[0].key, stored[1].key]

    a.release()
    b.release()
    del events[:]
    assert cache.evict(2) == 2
    [removed] = events
    assert removed.kind == "removed" and len(removed.pages) == 2
    assert not {p.key for p in removed.pages} & set(cache.pages)
    dl.prefix_release(cache, pool)
    assert events[-1] == dl.CacheEvent("cleared", ())
    teardown([], cache, pool)


def test_the_cache_runs_over_a_manager_with_no_kv_storage():
    pool = dl.BlockManager(page_rows=4, max_pages=6)
    cache = dl.create_prefix_cache(max_pages=3)
    assert not hasattr(pool, "k")
    a = dl.Session(pool=pool)
    pool.allocate([a], [13])                               # a trace's "evaluation": slots, no math
    pool.commit([a], [seq(0, 13)])
    assert dl.prefix_insert(cache, pool, a, a.tokens) == 3
    pages = a.page_table
    dl.release_kv_pages(a)
    s, n = attached(cache, pool, seq(0, 13))
    assert n == 12 and s.page_table == pages[:3] and s.tokens == seq(0, 12)
    hungry = dl.Session(pool=pool)
    pool.reserve(hungry, 12)                               # 3 free pages: no eviction needed
    with pytest.raises(dl.PoolExhausted):
        pool.reserve(hungry, 16)                           # s holds every cached page
    assert len(hungry.page_table) == 3                     # all or nothing
    dl.release_kv_pages(s)
    pool.reserve(hungry, 16)                               # now the cache gives one back
    assert dl.prefix_held_groups(cache) == 2
    dl.release_kv_pages(hungry)
    dl.prefix_release(cache, pool)
    pool.check()
    assert pool.num_used_pages == 0
