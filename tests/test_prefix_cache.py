"""The prefix cache of docs/design.md §3 on a tiny pool with fake evaluation (no model needed)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import engine as dl
from engine.prefix_cache import PrefixCache

from .prefix_helpers import (
    assert_cache_consistent,
    assert_session_sees,
    evaluated,
    evictable_pages,
    fake_eval,
    make_pool,
    teardown,
)

SYSTEM = list(range(100, 110))  # 10 tokens: 2 full pages of 4, and 2 tokens more


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def setup(page_rows: int = 4, max_pages: int | None = None, cache_pages: int = 0, hash_fn=None):
    pool = make_pool(page_rows, max_pages)
    cache = dl.create_prefix_cache(max_pages=cache_pages, hash_fn=hash_fn)
    return pool, cache


def attached(cache: PrefixCache, pool: dl.KVPool, prompt, namespace: str = ""):
    s = dl.Session(pool=pool)
    n = dl.prefix_attach(cache, pool, s, prompt, namespace)
    return s, n


# insert ------------------------------------------------------------------


def test_insert_keeps_full_pages_of_min_tokens_and_n_past():
    pool, cache = setup(page_rows=4)
    a = evaluated(pool, SYSTEM)                          # 10 tokens: 2 full pages + 2 rows
    assert dl.prefix_insert(cache, pool, a, SYSTEM, "sys") == 2
    assert dl.prefix_held_pages(cache) == sorted(a.page_table[:2])
    assert [int(pool.refcount[p]) for p in a.page_table] == [2, 2, 1]
    [chain] = dl.prefix_chain_list(cache)
    assert (chain.n_tokens, chain.pages_live, chain.hits, chain.preview) == (8, 2, 0, "sys")
    assert chain.last_hit_at is None and chain.created_at > 0

    b = evaluated(pool, seq(200, 12))                    # n_past 12, tokens shorter: 7 -> 1 page
    assert dl.prefix_insert(cache, pool, b, seq(200, 7)) == 1
    c = evaluated(pool, seq(300, 6))                     # tokens longer than n_past: covers 6
    assert dl.prefix_insert(cache, pool, c, seq(300, 16)) == 1
    assert cache.counters.inserted_pages == 4
    assert_cache_consistent(cache, pool)
    teardown([a, b, c], cache, pool)


def test_cached_page_only_refreshes_recency_and_chain_needs_a_new_page():
    pool, cache = setup(page_rows=4)
    a = evaluated(pool, seq(0, 8))
    assert dl.prefix_insert(cache, pool, a, a.tokens, "a") == 2
    a.release()
    d = evaluated(pool, seq(50, 8))
    assert dl.prefix_insert(cache, pool, d, d.tokens, "d") == 2
    d.release()
    stamps = {k: e.last_used for k, e in cache.pages.items()}

    # Same tokens from another session: nothing new, no chain, its private pages stay private.
    c = evaluated(pool, seq(0, 8))
    assert dl.prefix_insert(cache, pool, c, c.tokens, "again") == 0
    assert [ch.preview for ch in dl.prefix_chain_list(cache)] == ["a", "d"]
    assert [int(pool.refcount[p]) for p in c.page_table] == [1, 1]
    refreshed = [k for k, e in cache.pages.items() if e.last_used > stamps[k]]
    assert sorted(refreshed) == sorted(k for k, e in cache.pages.items() if e.chain_id == 1)

    # Recency decides eviction: "a" was refreshed after "d" was made, so d's leaf goes first.
    d_leaf = max((e for e in cache.pages.values() if e.chain_id == 2), key=lambda e: e.depth)
    assert cache.evict(1) == 1
    assert d_leaf.key not in cache.pages

    # One new page on top of a cached prefix: a chain of exactly that page.
    e = evaluated(pool, seq(0, 12))
    assert dl.prefix_insert(cache, pool, e, e.tokens, "e") == 1
    chains = dl.prefix_chain_list(cache)
    assert [(ch.preview, ch.n_tokens, ch.pages_live) for ch in chains] == \
        [("a", 8, 2), ("d", 8, 1), ("e", 4, 1)]
    assert [int(pool.refcount[p]) for p in e.page_table] == [1, 1, 2]
    assert_cache_consistent(cache, pool)
    teardown([c, e], cache, pool)


def test_insert_with_tokens_the_session_did_not_evaluate_raises():
    pool, cache = setup()
    s = evaluated(pool, seq(0, 8))
    wrong = seq(0, 8)
    wrong[5] = 999
    with pytest.raises(ValueError, match="position 5"):
        dl.prefix_insert(cache, pool, s, wrong)
    assert cache.pages == {} and cache.counters.inserted_pages == 0
    assert [int(pool.refcount[p]) for p in s.page_table] == [1, 1]
    # A released session cannot donate.
    s.release()
    with pytest.raises(ValueError, match="released"):
        dl.prefix_insert(cache, pool, s, seq(0, 8))
    teardown([], cache, pool)


# attach ------------------------------------------------------------------


def test_attach_needs_a_fresh_session():
    pool, cache = setup()
    a = evaluated(pool, seq(0, 9))
    dl.prefix_insert(cache, pool, a, a.tokens)
    with pytest.raises(ValueError, match="fresh session"):
        dl.prefix_attach(cache, pool, a, seq(0, 9))       # n_past > 0
    b = dl.Session(pool=pool)
    pool.reserve(b, 1)                                    # a page but n_past 0
    with pytest.raises(ValueError, match="fresh session"):
        dl.prefix_attach(cache, pool, b, seq(0, 9))
    c = dl.Session(pool=pool)
    c.release()
    with pytest.raises(ValueError, match="released"):
        dl.prefix_attach(cache, pool, c, seq(0, 9))
    other = make_pool()
    with pytest.raises(ValueError, match="another KV pool"):
        dl.prefix_attach(cache, other, dl.Session(pool=other), seq(0, 9))
    assert cache.counters.queries == 0                    # refused calls are not queries
    teardown([a, b], cache, pool)


@pytest.mark.parametrize("rows", [1, 2, 4, 16])
def test_attach_is_capped_one_token_short(rows):
    pool, cache = setup(page_rows=rows)
    k = 3
    prompt = seq(0, k * rows)
    a = evaluated(pool, prompt)
    assert dl.prefix_insert(cache, pool, a, prompt) == k
    sessions = [a]
    for n_prompt, want in [(k * rows, (k - 1) * rows), (k * rows + 1, k * rows),
                           (k * rows - 1, ((k * rows - 2) // rows) * rows), (1, 0)]:
        full = prompt[:n_prompt] + [7] * (n_prompt - len(prompt))
        s, n = attached(cache, pool, full)
        sessions.append(s)
        assert n == want
        assert n % rows == 0 and n <= n_prompt - 1
        assert s.n_past == n and len(s.page_table) == n // rows
        assert s.page_table == a.page_table[:n // rows]   # shared by reference, never copied
        fake_eval(s, full[n:])                            # the model evaluates >= 1 token
        assert_session_sees(s, full)
    teardown(sessions, cache, pool)


def test_attach_then_eval_never_writes_into_shared_pages():
    pool, cache = setup(page_rows=4)
    a = evaluated(pool, seq(0, 8))
    dl.prefix_insert(cache, pool, a, a.tokens)
    snapshot = pool.k[:, a.page_table].copy()
    b, n = attached(cache, pool, seq(0, 8) + [42, 43, 44])
    assert n == 8
    fake_eval(b, [42, 43, 44])
    for t in range(30):
        fake_eval(b, [t])
        fake_eval(a, [t + 1])
    np.testing.assert_array_equal(pool.k[:, a.page_table[:2]], snapshot)
    assert_session_sees(b, seq(0, 8) + [42, 43, 44] + list(range(30)))
    teardown([a, b], cache, pool)


def test_deepest_matched_page_gives_its_chain_the_hit():
    pool, cache = setup(page_rows=4)
    a = evaluated(pool, SYSTEM[:8])
    dl.prefix_insert(cache, pool, a, a.tokens, "system")
    b = evaluated(pool, SYSTEM[:8] + seq(500, 8))
    assert dl.prefix_insert(cache, pool, b, b.tokens, "turn") == 2

    def hits():
        sys_chain, turn_chain = dl.prefix_chain_list(cache)
        return sys_chain.hits, turn_chain.hits

    s1, n1 = attached(cache, pool, SYSTEM[:8] + seq(500, 8) + [1])
    assert n1 == 16
    assert hits() == (0, 1)
    sys_chain, turn_chain = dl.prefix_chain_list(cache)
    assert turn_chain.last_hit_at is not None and sys_chain.last_hit_at is None
    s2, n2 = attached(cache, pool, SYSTEM[:8] + seq(500, 3) + [9, 9])
    assert n2 == 8
    assert hits() == (1, 1)
    s3, n3 = attached(cache, pool, seq(700, 20))
    assert n3 == 0 and hits() == (1, 1)
    teardown([a, b, s1, s2, s3], cache, pool)


def test_counters():
    pool, cache = setup(page_rows=4, cache_pages=3)
    assert vars(cache.counters) == dict(queries=0, hits=0, hit_pages=0, inserted_pages=0,
                                        evicted_pages=0, tokens_saved=0, demoted_pages=0,
                                        disk_hit_pages=0, disk_hits=0)
    a = evaluated(pool, seq(0, 12))
    dl.prefix_insert(cache, pool, a, a.tokens)            # 3 pages
    a.release()
    s1, _ = attached(cache, pool, seq(0, 13))              # 3 pages, 12 tokens
    s2, _ = attached(cache, pool, seq(0, 6))               # 1 page (cap), 4 tokens
    s3, _ = attached(cache, pool, seq(40, 9))              # miss
    b = evaluated(pool, seq(80, 8))
    dl.prefix_insert(cache, pool, b, b.tokens)            # 2 more: over budget by 2
    # s1 holds all of a's pages and b holds its own: nothing is evictable yet.
    assert cache.counters.evicted_pages == 0 and len(cache.pages) == 5
    s1.release()
    s2.release()
    b.release()                                           # the releases enforce the budget
    assert cache.counters.evicted_pages == 2 and len(cache.pages) == 3
    c = evaluated(pool, seq(0, 4))
    assert dl.prefix_insert(cache, pool, c, c.tokens) == 0  # refreshes only
    assert vars(cache.counters) == dict(queries=3, hits=2, hit_pages=4, inserted_pages=5,
                                        evicted_pages=2, tokens_saved=16, demoted_pages=0,
                                        disk_hit_pages=0, disk_hits=0)
    assert len(cache.pages) == 3
    teardown([s3, c], cache, pool)


# namespaces --------------------------------------------------------------


def test_namespaces_never_share_a_page():
    pool, cache = setup(page_rows=4)
    a = evaluated(pool, seq(0, 9))
    assert dl.prefix_insert(cache, pool, a, a.tokens, namespace="alice") == 2
    s, n = attached(cache, pool, seq(0, 9), namespace="bob")
    assert n == 0 and s.page_table == []
    assert dl.prefix_probe(cache, seq(0, 9), "bob").stop_reason == "miss"
    # The same pool pages cannot be cached again under another namespace.
    chains = len(dl.prefix_chain_list(cache))
    assert dl.prefix_insert(cache, pool, a, a.tokens, namespace="bob") == 0
    assert len(dl.prefix_chain_list(cache)) == chains and len(cache.chains) == chains
    b = evaluated(pool, seq(0, 9))
    assert dl.prefix_insert(cache, pool, b, b.tokens, namespace="bob") == 2
    alice = {e.page for e in cache.pages.values() if e.namespace == "alice"}
    bob = {e.page for e in cache.pages.values() if e.namespace == "bob"}
    assert alice == set(a.page_table[:2]) and bob == set(b.page_table[:2])
    sa, na = attached(cache, pool, seq(0, 9), namespace="alice")
    sb, nb = attached(cache, pool, seq(0, 9), namespace="bob")
    sd, nd = attached(cache, pool, seq(0, 9))             # the default namespace is its own
    assert (na, nb, nd) == (8, 8, 0)
    assert sa.page_table == a.page_table[:2] and sb.page_table == b.page_table[:2]
    assert_cache_consistent(cache, pool)
    teardown([a, b, s, sa, sb, sd], cache, pool)


# probe -------------------------------------------------------------------


def probe_setup():
    pool, cache = setup(page_rows=4)
    a = evaluated(pool, seq(0, 12))                       # pages [0..3] [4..7] [8..11]
    dl.prefix_insert(cache, pool, a, a.tokens, "a")
    b = evaluated(pool, seq(0, 4) + [50, 51, 52, 53])     # sibling of page 1
    dl.prefix_insert(cache, pool, b, b.tokens, "b")
    return pool, cache, [a, b]


def test_probe_stop_reasons_and_first_diff_index():
    pool, cache, sessions = probe_setup()
    probe = dl.prefix_probe
    # cap: the prompt is exactly three cached pages; attach keeps its last token for the model.
    r = probe(cache, seq(0, 12))
    assert (r.matched_tokens, r.matched_pages, r.stop_reason, r.first_diff_index) == \
        (8, 2, "cap", None)
    assert r.nearest_chain_id == 1
    # miss: diverges at position 6 inside page 1; the nearest cached page shares 2 tokens.
    r = probe(cache, seq(0, 6) + [99, 99, 99])
    assert (r.matched_tokens, r.stop_reason, r.first_diff_index, r.nearest_chain_id) == \
        (4, "miss", 6, 1)
    assert r.cached_token == 6  # the nearest cached page holds seq's token 6 where the prompt has 99
    r = probe(cache, seq(0, 4) + [50, 51, 77, 77, 1])
    assert (r.matched_tokens, r.stop_reason, r.first_diff_index, r.nearest_chain_id) == \
        (4, "miss", 6, 2)
    r = probe(cache, [5] + seq(1, 10))                     # differs at the very first token
    assert (r.matched_tokens, r.stop_reason, r.first_diff_index) == (0, "miss", 0)
    r = probe(cache, seq(0, 12) + [1, 2, 3, 4, 5])         # past every cached page
    assert (r.matched_tokens, r.stop_reason, r.first_diff_index) == (12, "miss", 12)
    assert r.nearest_chain_id == 1
    # end: the prompt runs out of full pages; the partial tail matches or departs.
    r = probe(cache, seq(0, 10))
    assert (r.matched_tokens, r.stop_reason, r.first_diff_index) == (8, "end", None)
    r = probe(cache, seq(0, 9) + [99])
    assert (r.matched_tokens, r.stop_reason, r.first_diff_index) == (8, "end", 9)
    r = probe(cache, [0, 1])
    assert (r.matched_tokens, r.stop_reason, r.first_diff_index) == (0, "end", None)
    r = probe(cache, [])
    assert (r.matched_tokens, r.stop_reason, r.first_diff_index) == (0, "end", None)
    empty = dl.create_prefix_cache()
    assert dl.prefix_probe(empty, seq(0, 9)).stop_reason == "miss"
    teardown(sessions, cache, pool)


def test_probe_is_read_only_and_agrees_with_attach():
    pool, cache, sessions = probe_setup()
    prompts = [seq(0, n) for n in range(0, 16)] + [seq(0, 4) + [50, 51, 52, 53, 1], [9] * 9]
    counters = vars(cache.counters).copy()
    stamps = {k: e.last_used for k, e in cache.pages.items()}
    refs = pool.refcount.copy()
    results = [dl.prefix_probe(cache, p) for p in prompts]
    assert vars(cache.counters) == counters
    assert {k: e.last_used for k, e in cache.pages.items()} == stamps
    np.testing.assert_array_equal(pool.refcount, refs)
    assert [c.hits for c in dl.prefix_chain_list(cache)] == [0, 0]
    for p, r in zip(prompts, results, strict=True):
        s, n = attached(cache, pool, p)
        assert n == r.matched_tokens and len(s.page_table) == r.matched_pages
        sessions.append(s)
    teardown(sessions, cache, pool)


# eviction ----------------------------------------------------------------


def test_budget_evicts_lru_leaves_deepest_first_never_held_never_stranding():
    pool, cache = setup(page_rows=2, cache_pages=4)
    a = evaluated(pool, seq(0, 6))                        # 3 pages
    dl.prefix_insert(cache, pool, a, a.tokens, "a")
    a_pages = list(a.page_table)
    a.release()
    c = evaluated(pool, seq(20, 2))                       # 1 page, touched after a
    dl.prefix_insert(cache, pool, c, c.tokens, "c")
    c_pages = c.page_table[:1]
    c.release()
    b = evaluated(pool, seq(40, 6))                       # 3 pages, held by b: over by 3
    assert dl.prefix_insert(cache, pool, b, b.tokens, "b") == 3
    # a is least recently used and goes deepest page first (a parent is never newer than its
    # child, so the whole chain goes before c); b's pages are held by b.
    assert dl.prefix_held_pages(cache) == sorted(b.page_table[:3] + c_pages)
    assert [int(pool.refcount[p]) for p in a_pages] == [0, 0, 0]
    assert cache.counters.evicted_pages == 3
    assert [(ch.preview, ch.pages_live) for ch in dl.prefix_chain_list(cache)] == \
        [("c", 1), ("b", 3)]
    assert_cache_consistent(cache, pool)
    # b is still running: none of its pages may go, even when asked directly.
    assert cache.evict(10) == 1                           # only c's page was evictable
    b_pages = b.page_table[:3]
    assert dl.prefix_held_pages(cache) == sorted(b_pages)
    assert_session_sees(b, seq(40, 6))
    b.release()
    assert cache.evict(1) == 1                            # now b's deepest page
    assert dl.prefix_held_pages(cache) == sorted(b_pages[:2])
    assert_cache_consistent(cache, pool)
    teardown([], cache, pool)


def test_lru_order_follows_attach_recency():
    pool, cache = setup(page_rows=2)
    x = evaluated(pool, seq(0, 4))
    dl.prefix_insert(cache, pool, x, x.tokens, "x")
    y = evaluated(pool, seq(10, 4))
    dl.prefix_insert(cache, pool, y, y.tokens, "y")
    x_pages, y_pages = list(x.page_table), list(y.page_table)
    x.release()
    y.release()
    s, n = attached(cache, pool, seq(0, 5))               # x used again: y is now LRU
    assert n == 4
    s.release()
    evicted = []
    while cache.pages:
        before = set(cache.by_page)
        assert cache.evict(1) == 1
        [page] = before - set(cache.by_page)
        evicted.append(page)
    assert evicted == [y_pages[1], y_pages[0], x_pages[1], x_pages[0]]
    teardown([], cache, pool)


def test_a_cached_parent_whose_child_is_held_is_not_evicted():
    pool, cache = setup(page_rows=2)
    a = evaluated(pool, seq(0, 4))                        # R, X
    dl.prefix_insert(cache, pool, a, a.tokens)
    a.release()
    b = evaluated(pool, seq(0, 6))                        # private copies of R, X, and Y
    assert dl.prefix_insert(cache, pool, b, b.tokens) == 1
    assert evictable_pages(cache, pool) == []
    assert cache.evict(10) == 0                           # evicting R or X would strand Y
    b.release()
    order = []
    while cache.pages:
        deepest = max(e.depth for e in cache.pages.values())
        assert cache.evict(1) == 1
        order.append(deepest)
        assert_cache_consistent(cache, pool)
    assert order == [2, 1, 0]
    teardown([], cache, pool)


def test_bounded_pool_evicts_from_the_cache_then_raises_pool_exhausted():
    pool, cache = setup(page_rows=2, max_pages=6)
    a = evaluated(pool, seq(0, 8))                        # 4 pages
    dl.prefix_insert(cache, pool, a, a.tokens)
    a.release()
    assert pool.num_free_pages == 2
    b = evaluated(pool, seq(100, 10))                     # 5 pages: 2 free + 3 evicted
    assert cache.counters.evicted_pages == 3
    assert len(cache.pages) == 1 and next(iter(cache.pages.values())).depth == 0
    assert_session_sees(b, seq(100, 10))
    assert_cache_consistent(cache, pool)
    # Attach a's root: now the one cached page is held, nothing is evictable.
    c, n = attached(cache, pool, seq(0, 3))
    assert n == 2 and pool.num_free_pages == 0
    with pytest.raises(dl.PoolExhausted, match="KV pool is full.*nothing it can evict"):
        fake_eval(c, [2])
    assert evictable_pages(cache, pool) == [] and len(cache.pages) == 1
    pool.check()
    # Releasing c makes the root evictable: the next alloc takes it.
    c.release()
    d = evaluated(pool, [1, 2])
    assert cache.pages == {} and cache.counters.evicted_pages == 4
    with pytest.raises(dl.PoolExhausted):
        evaluated(pool, [3])
    pool.check()
    teardown([b, d], cache, pool)


def test_leaf_heap_stays_bounded_without_eviction():
    pool, cache = setup(page_rows=2)
    a = evaluated(pool, seq(0, 6))
    dl.prefix_insert(cache, pool, a, a.tokens)
    for _ in range(2000):
        s, _ = attached(cache, pool, seq(0, 7))
        s.release()
    assert len(cache.policy.heap) <= 2 * len(cache.pages) + 64
    a.release()
    assert cache.evict(3) == 3 and cache.pages == {}
    teardown([], cache, pool)


# regressions -------------------------------------------------------------


def test_donated_page_keeps_identity_and_content_after_the_donor_releases():
    # nano-vllm "fix cache hit": a freed block's stale hash must never serve another prompt.
    pool, cache = setup(page_rows=4)
    a = evaluated(pool, seq(0, 9))
    dl.prefix_insert(cache, pool, a, a.tokens)
    pages = a.page_table[:2]
    content = pool.k[:, pages].copy()
    a.release()
    assert all(int(pool.refcount[p]) == 1 for p in pages)
    others = [evaluated(pool, seq(1000 + 40 * i, 16)) for i in range(20)]  # reuse free pages
    assert not set(pages) & {p for o in others for p in o.page_table}
    s, n = attached(cache, pool, seq(0, 9))
    assert n == 8 and s.page_table == pages
    np.testing.assert_array_equal(pool.k[:, pages], content)
    fake_eval(s, [8])
    assert_session_sees(s, seq(0, 9))
    s.release()
    # Evicted pages go back to the pool; whoever gets them next, the cache no longer routes there.
    assert cache.evict(2) == 2
    t = evaluated(pool, seq(5000, 8))
    assert set(t.page_table) == set(pages)                # the same page ids, new content
    r, n = attached(cache, pool, seq(0, 9))
    assert n == 0 and dl.prefix_probe(cache, seq(0, 9)).stop_reason == "miss"
    teardown(others + [t, r], cache, pool)


def test_forced_hash_collision_never_attaches_wrong_tokens():
    pool, cache = setup(page_rows=4, hash_fn=lambda b: 7)
    a = evaluated(pool, seq(0, 12))
    assert dl.prefix_insert(cache, pool, a, a.tokens) == 1   # page 1 collides with page 0
    b = evaluated(pool, seq(50, 12))
    assert dl.prefix_insert(cache, pool, b, b.tokens) == 0   # its root collides with a's
    r = dl.prefix_probe(cache, seq(50, 12))
    assert (r.matched_tokens, r.stop_reason) == (0, "token_mismatch")
    assert r.first_diff_index == 0
    r = dl.prefix_probe(cache, seq(0, 2) + [9, 9, 9])
    assert (r.matched_tokens, r.stop_reason, r.first_diff_index) == (0, "token_mismatch", 2)
    r = dl.prefix_probe(cache, seq(0, 12))
    assert (r.matched_tokens, r.stop_reason, r.first_diff_index) == (4, "token_mismatch", 4)
    s1, n1 = attached(cache, pool, seq(50, 12))
    s2, n2 = attached(cache, pool, seq(0, 12))
    assert (n1, n2) == (0, 4)
    fake_eval(s1, seq(50, 12))
    fake_eval(s2, seq(4, 8))
    assert_session_sees(s1, seq(50, 12))
    assert_session_sees(s2, seq(0, 12))
    teardown([a, b, s1, s2], cache, pool)


def test_few_hash_buckets_route_but_tokens_verify():
    def three_buckets(b: bytes) -> int:
        return hashlib.blake2b(b, digest_size=8).digest()[0] % 3

    rng = np.random.default_rng(0)
    pool, cache = setup(page_rows=2, hash_fn=three_buckets)
    sessions = []
    for _ in range(60):
        prompt = rng.integers(0, 4, size=int(rng.integers(1, 9))).tolist()
        s, n = attached(cache, pool, prompt)
        fake_eval(s, prompt[n:])
        assert_session_sees(s, prompt)                    # whatever it attached was right
        dl.prefix_insert(cache, pool, s, prompt)
        sessions.append(s)
    assert_cache_consistent(cache, pool)
    assert len(cache.pages) <= 3
    teardown(sessions, cache, pool)


def test_teardown_in_either_order_leaves_the_pool_empty():
    pool, cache = setup(page_rows=4)
    a = evaluated(pool, seq(0, 9))
    dl.prefix_insert(cache, pool, a, a.tokens)
    b, _ = attached(cache, pool, seq(0, 9))
    fake_eval(b, [8])
    # The cache may let go first: the sessions still hold the pages until they release.
    assert dl.prefix_release(cache, pool) == 2
    assert dl.prefix_held_groups(cache) == 0 and dl.prefix_chain_list(cache) == []
    assert_session_sees(b, seq(0, 9))
    a.release()
    b.release()
    pool.check()
    assert pool.num_used_pages == 0
    with pytest.raises(ValueError, match="already released"):
        b.release()
    with pytest.raises(ValueError, match="already free"):
        pool.release(0)
    pool.check()
    teardown([], cache, pool)


# costs (counted, not timed) ------------------------------------------------


class CountingDict(dict):
    """A dict that counts every lookup, store and delete: cache entries touched."""

    def __init__(self, *args):
        super().__init__(*args)
        self.touched = 0

    def get(self, key, default=None):
        self.touched += 1
        return super().get(key, default)

    def __getitem__(self, key):
        self.touched += 1
        return super().__getitem__(key)

    def __contains__(self, key):
        self.touched += 1
        return super().__contains__(key)

    def __setitem__(self, key, value):
        self.touched += 1
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self.touched += 1
        super().__delitem__(key)

    def __iter__(self):
        self.touched += len(self)
        return super().__iter__()

    def values(self):
        self.touched += len(self)
        return super().values()

    def items(self):
        self.touched += len(self)
        return super().items()


def test_costs_are_per_page_of_the_prompt_not_per_cached_page():
    rows, n_sys, n_turn, n_prompts = 2, 4, 10, 1000
    pool, cache = setup(page_rows=rows)
    system = seq(0, n_sys * rows)
    for i in range(n_prompts):
        prompt = system + [1000 + i] + seq(10_000 + 20 * i, n_turn * rows - 1)
        s, _ = attached(cache, pool, prompt)
        fake_eval(s, prompt[s.n_past:])
        dl.prefix_insert(cache, pool, s, prompt)
        s.release()
    assert len(cache.pages) == n_sys + n_prompts * n_turn >= 10_000
    calls = {"hash": 0}
    real_hash = cache.hash_fn

    def counting_hash(b: bytes) -> int:
        calls["hash"] += 1
        return real_hash(b)

    cache.hash_fn = counting_hash
    cache.pages = CountingDict(cache.pages)
    cache.by_page = CountingDict(cache.by_page)

    def cost(fn):
        cache.pages.touched, cache.by_page.touched, calls["hash"] = 0, 0, 0
        out = fn()
        return out, cache.pages.touched + cache.by_page.touched + calls["hash"]

    prompt_pages = n_sys + n_turn
    budget = 8 * prompt_pages + 16  # a constant number of look-ups per page of the prompt
    old = system + [1000 + 500] + seq(10_000 + 20 * 500, n_turn * rows)
    s = dl.Session(pool=pool)
    n, c = cost(lambda: dl.prefix_attach(cache, pool, s, old))
    assert n == prompt_pages * rows and c <= budget
    new = system + [5] + seq(90_000, n_turn * rows - 1)
    t = dl.Session(pool=pool)
    n, c = cost(lambda: dl.prefix_attach(cache, pool, t, new))
    assert n == n_sys * rows and c <= budget
    fake_eval(t, new[n:])
    added, c = cost(lambda: dl.prefix_insert(cache, pool, t, new))
    assert added == n_turn and c <= budget
    # Diverging right after the system prompt: 1001 cached siblings to find the nearest in.
    r, c = cost(lambda: dl.prefix_probe(cache, system + [1000 + 7, 7] + new[10:]))
    assert (r.stop_reason, r.matched_tokens, r.first_diff_index) == ("miss", 8, 9)
    assert r.nearest_chain_id == 1 + 7 and c <= budget
    for k in (1, 10, 100):
        evicted, c = cost(lambda k=k: cache.evict(k))
        assert evicted == k and c <= 8 * k + 16
    teardown([s, t], cache, pool)


def test_a_new_session_gets_a_released_sessions_pages_side_by_side():
    """Pages come back in ascending order, so a page table stays one run of ids (attention
    then reads the session's keys as a view of the pool, not a copy per layer)."""
    from engine.attention import page_index
    pool = make_pool(page_rows=4)
    first = dl.Session(pool=pool)
    fake_eval(first, seq(0, 12))
    table = list(first.page_table)
    first.release()
    second = dl.Session(pool=pool)
    fake_eval(second, seq(50, 12))
    assert list(second.page_table) == table == list(range(table[0], table[0] + 3))
    assert isinstance(page_index(second.page_table), slice)
