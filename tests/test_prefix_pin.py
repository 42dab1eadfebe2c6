"""Pinned chains (docs/design.md §12): never evicted, counted against the budget; an insert that
would need a pinned page caches less and says so."""

from __future__ import annotations

import logging

import pytest

import engine as dl

from .prefix_helpers import assert_cache_consistent, assert_session_sees, evaluated, make_pool, teardown


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def donate(cache, pool, tokens, preview=""):
    s = evaluated(pool, tokens)
    added = dl.prefix_insert(cache, pool, s, tokens, preview)
    s.release()
    return added


def test_pinned_chain_stays_whole_under_budget_pressure_and_unpin_lets_it_go():
    pool = make_pool(page_rows=4)
    cache = dl.create_prefix_cache(max_pages=6)
    pinned_tokens = seq(100, 12)                      # 3 pages
    donate(cache, pool, pinned_tokens, "system")
    [chain] = dl.prefix_chain_list(cache)
    dl.prefix_pin(cache, chain.id)
    assert dl.prefix_chain_list(cache)[0].pinned
    for i in range(5):                                # 5 more 3-page chains: only 3 pages of room
        donate(cache, pool, seq(1000 * (i + 2), 12), f"q{i}")
    live = {c.id: c for c in dl.prefix_chain_list(cache)}
    assert live[chain.id].pages_live == 3             # whole, though it is the oldest
    assert len(cache.pages) <= 6
    s = dl.Session(pool=pool)
    assert dl.prefix_attach(cache, pool, s, pinned_tokens + [1]) == 12
    assert_session_sees(s, pinned_tokens)
    s.release()
    # unpinned, it is the least recently used chain once others are touched: it goes
    dl.prefix_unpin(cache, chain.id)
    for i in range(3):
        donate(cache, pool, seq(50_000 + 1000 * i, 12), f"r{i}")
    assert chain.id not in {c.id for c in dl.prefix_chain_list(cache)}
    assert_cache_consistent(cache, pool)
    teardown([], cache, pool)


def test_insert_that_would_evict_a_pinned_page_caches_less_and_says_so(caplog):
    pool = make_pool(page_rows=4)
    cache = dl.create_prefix_cache(max_pages=4)
    donate(cache, pool, seq(100, 12), "system")       # 3 pages
    dl.prefix_pin(cache, dl.prefix_chain_list(cache)[0].id)
    with caplog.at_level(logging.INFO, logger="prefixlab.cache"):
        added = donate(cache, pool, seq(500, 16), "long question")  # 4 pages; 1 fits beside the pin
    assert added == 1 and added.left_out_for_pins == 3
    assert "3 page(s)" in caplog.text and "pinned" in caplog.text
    assert len(cache.pages) == 4
    assert_cache_consistent(cache, pool)
    teardown([], cache, pool)


def test_pinned_pages_are_not_evicted_for_a_bounded_pool():
    pool = make_pool(page_rows=4, max_pages=4)
    cache = dl.create_prefix_cache()
    donate(cache, pool, seq(100, 12), "system")
    dl.prefix_pin(cache, dl.prefix_chain_list(cache)[0].id)
    assert cache.num_evictable() == 0
    s = dl.Session(pool=pool)
    with pytest.raises(dl.PoolExhausted):
        pool.reserve(s, 8)                            # 2 pages: only 1 free, the rest pinned
    s.release()
    dl.prefix_unpin(cache, dl.prefix_chain_list(cache)[0].id)
    s = dl.Session(pool=pool)
    pool.reserve(s, 8)
    s.release()
    teardown([], cache, pool)


def test_pin_of_a_missing_chain_is_a_clear_error():
    cache = dl.create_prefix_cache()
    with pytest.raises(ValueError, match="chain 7 does not exist"):
        dl.prefix_pin(cache, 7)
