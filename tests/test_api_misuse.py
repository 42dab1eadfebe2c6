"""Misuse of the functional API gets a clear error and leaves every state as it was."""

from __future__ import annotations

import numpy as np
import pytest

import engine as dl
from engine.loop import EngineLoop
from engine.scheduler import SchedulerSettings


@pytest.fixture
def setup(tiny_model):
    pool = dl.create_kv_pool(tiny_model, page_rows=4)
    cache = dl.create_prefix_cache()
    s = dl.create_session(tiny_model, pool)
    prompt = list(range(3, 15))
    dl.eval(tiny_model, s, prompt)
    return tiny_model, pool, cache, s, prompt


def snapshot(pool, s):
    return pool.refcount.copy(), pool.num_free_pages, list(s.page_table), s.n_past, list(s.tokens)


def same(a, b) -> bool:
    return np.array_equal(a[0], b[0]) and a[1:] == b[1:]


def test_attach_on_a_used_session(setup):
    m, pool, cache, s, prompt = setup
    dl.prefix_insert(cache, pool, s, prompt)
    before = snapshot(pool, s)
    with pytest.raises(ValueError, match="fresh session"):
        dl.prefix_attach(cache, pool, s, prompt)
    assert same(before, snapshot(pool, s))


def test_eval_on_a_released_session_and_release_twice(setup):
    m, pool, cache, s, prompt = setup
    dl.release_kv_pages(s)
    free = pool.num_free_pages
    with pytest.raises(ValueError, match="released"):
        dl.eval(m, s, [1])
    with pytest.raises(ValueError, match="already released"):
        dl.release_kv_pages(s)
    assert pool.num_free_pages == free
    pool.check()


def test_insert_covers_only_what_ran(setup):
    m, pool, cache, s, prompt = setup
    # Tokens past n_past are not in the KV: only the evaluated full pages are donated.
    added = dl.prefix_insert(cache, pool, s, prompt + [20, 21, 22, 23, 24, 25])
    assert added == len(prompt) // 4
    with pytest.raises(ValueError, match="differ from what session"):
        dl.prefix_insert(cache, pool, s, [9] + prompt[1:])


def test_tokens_outside_the_vocabulary(setup):
    m, pool, cache, s, prompt = setup
    before = snapshot(pool, s)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dl.eval(m, s, [m.config.vocab_size])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dl.eval(m, s, [-1])
    assert same(before, snapshot(pool, s))


def test_session_from_another_pool(setup):
    m, pool, cache, s, prompt = setup
    other_pool = dl.create_kv_pool(m, page_rows=4)
    t = dl.create_session(m, other_pool)
    with pytest.raises(ValueError, match="another KV pool"):
        dl.eval_batch(m, [s, t], [[1], [2]])
    dl.prefix_insert(cache, pool, s, prompt)
    with pytest.raises(ValueError, match="another KV pool"):
        dl.prefix_attach(cache, other_pool, t, prompt)
    with pytest.raises(ValueError, match="another KV pool"):
        dl.prefix_insert(cache, pool, t, prompt)
    assert t.n_past == 0 and not t.page_table
    other_pool.check()


def test_a_second_cache_on_one_pool_is_refused_and_the_first_still_evicts(tiny_model):
    # the pool asks one cache for pages when it runs out: a second would hold pages it never gives back
    pool = dl.create_kv_pool(tiny_model, page_rows=4, max_pages=4)
    first, second = dl.create_prefix_cache(), dl.create_prefix_cache()
    s = dl.create_session(tiny_model, pool)
    prompt = list(range(3, 15))
    dl.eval(tiny_model, s, prompt)
    assert dl.prefix_insert(first, pool, s, prompt) == 3
    with pytest.raises(ValueError, match="already has a prefix cache"):
        dl.prefix_insert(second, pool, s, prompt)
    assert dl.prefix_held_groups(second) == 0 and dl.prefix_held_groups(first) == 3
    dl.release_kv_pages(s)
    t = dl.create_session(tiny_model, pool)
    dl.eval(tiny_model, t, list(range(20, 35)))  # 4 pages: the first cache gives its 3 back
    assert dl.prefix_held_groups(first) == 0 and first.counters.evicted_pages == 3
    pool.check()


def test_settings_out_of_range(tiny_model):
    with pytest.raises(ValueError, match="page_rows"):
        dl.create_kv_pool(tiny_model, page_rows=0)
    with pytest.raises(ValueError, match="max_pages"):
        dl.create_kv_pool(tiny_model, max_pages=0)
    with pytest.raises(ValueError, match="max_pages"):
        dl.create_prefix_cache(max_pages=-1)
    loop = EngineLoop(tiny_model, SchedulerSettings(page_rows=4, pool_pages=2))
    with pytest.raises(ValueError, match="pool has only 2"):
        loop.submit_now(prompt=list(range(3, 30)), max_new_tokens=4)


def test_full_pool_raises_pool_exhausted_and_keeps_state(tiny_model):
    pool = dl.create_kv_pool(tiny_model, page_rows=4, max_pages=3)
    s = dl.create_session(tiny_model, pool)
    dl.eval(tiny_model, s, list(range(3, 15)))  # 3 pages
    before = snapshot(pool, s)
    with pytest.raises(dl.PoolExhausted, match="KV pool is full"):
        dl.eval(tiny_model, s, [5])
    assert same(before, snapshot(pool, s))
    dl.release_kv_pages(s)
    assert pool.num_used_pages == 0
