"""Fake evaluation for prefix-cache tests: a tiny pool and K/V that encode the prefix.

The K/V written at position p is a function of tokens[0..p] (as a real model's is),
so a page's content says exactly which prefix it was computed for: a wrong attach,
a page overwritten while shared, or a page cached under the wrong tokens all show up
as a content mismatch.
"""

from __future__ import annotations

import numpy as np

import engine as dl
from engine.prefix_cache import PrefixCache
from engine.prefix_records import CachedPage

TINY = dl.ModelConfig(n_layers=1, d_model=8, n_ff=16, n_heads=2, n_kv_heads=1, head_dim=4,
                      vocab_size=1000, context_length=1 << 20, rope_base=1e4, norm_eps=1e-5)

_MOD = (1 << 61) - 1
# One float per (layer, kv head, dim): small multiples of 1/8 keep every value exact in float32.
_LANES = (np.arange(TINY.n_layers * TINY.n_kv_heads * TINY.head_dim, dtype=np.float32) / 8
          ).reshape(TINY.n_layers, TINY.n_kv_heads, TINY.head_dim)


def make_pool(page_rows: int = 4, max_pages: int | None = None) -> dl.KVPool:
    """A KV pool over the tiny config."""
    return dl.KVPool(TINY, page_rows=page_rows, max_pages=max_pages)


def prefix_codes(tokens) -> np.ndarray:
    """codes[p] identifies tokens[0..p] (a rolling hash, < 2**18 so it is exact in float32)."""
    out = np.empty(len(tokens), dtype=np.float32)
    h = 0
    for i, t in enumerate(tokens):
        h = (h * 1_000_003 + int(t) + 1) % _MOD
        out[i] = h % (1 << 18)
    return out


def expected_kv(tokens) -> tuple[np.ndarray, np.ndarray]:
    """K and V a fake model writes for `tokens`: [layers, positions, kv_heads, head_dim]."""
    codes = prefix_codes(tokens)
    k = codes[None, :, None, None] + _LANES[:, None, :, :]
    return k, -k - 0.5


def fake_eval(s: dl.Session, tokens) -> None:
    """Evaluate `tokens` on `s` as `engine.model.forward` would, writing recognizable K/V."""
    toks = [int(t) for t in tokens]
    if not toks:
        raise ValueError("no tokens to evaluate")
    pool, rows, start = s.pool, s.pool.page_rows, s.n_past
    [slots] = pool.allocate([s], [len(toks)])  # may raise PoolExhausted, as a real eval does
    pos = np.arange(start, start + len(toks))
    pages = np.asarray(slots.page_table, dtype=np.int64)[pos // rows]
    k, v = expected_kv(s.tokens + toks)
    pool.k[:, pages, pos % rows] = k[:, start:]
    pool.v[:, pages, pos % rows] = v[:, start:]
    pool.commit([s], [toks])


def evaluated(pool: dl.KVPool, tokens) -> dl.Session:
    """A new session that has fake-evaluated `tokens`."""
    s = dl.Session(pool=pool)
    fake_eval(s, tokens)
    return s


def session_kv(s: dl.Session) -> tuple[np.ndarray, np.ndarray]:
    """K and V of the session's first n_past positions, read through its page table."""
    c = s.pool.cfg
    k = s.pool.k[:, s.page_table].reshape(c.n_layers, -1, c.n_kv_heads, c.head_dim)[:, :s.n_past]
    v = s.pool.v[:, s.page_table].reshape(c.n_layers, -1, c.n_kv_heads, c.head_dim)[:, :s.n_past]
    return k, v


def assert_same(actual: np.ndarray, expected: np.ndarray) -> None:
    """np.testing.assert_array_equal, whose message it gives on a mismatch, without its cost on a
    match (~70 us a call: the state machine's invariants make 50,000 of them)."""
    if not np.array_equal(actual, expected):
        np.testing.assert_array_equal(actual, expected)


def assert_session_sees(s: dl.Session, tokens) -> None:
    """The session has evaluated exactly `tokens` and its pages hold their K/V."""
    assert s.tokens == [int(t) for t in tokens]
    assert s.n_past == len(tokens)
    k, v = session_kv(s)
    ek, ev = expected_kv(tokens)
    assert_same(k, ek)
    assert_same(v, ev)


def path_tokens(cache: PrefixCache, entry: CachedPage) -> list[int]:
    """Every token from the root of the entry's chain to the end of its page."""
    parts = []
    while entry is not None:
        parts.append(entry.tokens)
        entry = cache.pages[entry.parent] if entry.parent is not None else None
    return [t for part in reversed(parts) for t in part]


def assert_cache_consistent(cache: PrefixCache, pool: dl.KVPool) -> None:
    """Tree links, counts and the content of every cached page match its tokens."""
    rows = pool.page_rows
    assert set(cache.by_page) == {e.page for e in cache.pages.values()}
    assert len(cache.by_page) == len(cache.pages)
    live: dict[int, int] = {}
    for key, e in cache.pages.items():
        assert e.key == key and cache.by_page[e.page] == key
        assert pool.refcount[e.page] >= 1, "a cached page was freed"
        assert len(e.tokens) == rows
        if e.parent is None:
            assert e.depth == 0 and key in cache.roots[e.namespace]
        else:
            parent = cache.pages[e.parent]  # never stranded: the parent is still cached
            assert key in parent.children and e.depth == parent.depth + 1
            assert parent.namespace == e.namespace
        for child in e.children:
            assert cache.pages[child].parent == key
        live[e.chain_id] = live.get(e.chain_id, 0) + 1
        toks = path_tokens(cache, e)
        ek, ev = expected_kv(toks)
        assert_same(pool.k[:, e.page], ek[:, -rows:])
        assert_same(pool.v[:, e.page], ev[:, -rows:])
    assert {c.id: c.pages_live for c in cache.chains.values()} == live


def evictable_pages(cache: PrefixCache, pool: dl.KVPool) -> list[int]:
    """Cached pages the cache could give back now: leaves no session holds."""
    return [e.page for e in cache.pages.values() if not e.children and pool.refcount[e.page] == 1]


def teardown(sessions, cache: PrefixCache, pool: dl.KVPool) -> None:
    """The documented order: sessions, then the cache; then the pool must be empty."""
    for s in sessions:
        if not s.released:
            s.release()
    dl.prefix_release(cache, pool)
    pool.check()
    assert pool.num_used_pages == 0
    assert (pool.refcount == 0).all()
