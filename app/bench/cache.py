"""Bench section "Prefix cache": attach, insert and eviction cost per page with 10,000 cached pages.

No model math: a tiny ModelConfig pool and fake sessions whose pages are allocated and
tokens committed with no forward pass, so the figures are the cache's own bookkeeping
(hashing, verification, the LRU heap).
"""

from __future__ import annotations

import time

import numpy as np

from engine import ModelConfig, create_prefix_cache, prefix_attach, prefix_insert
from engine.kv_pool import KVPool, Session

from .common import figure

FEATURE = "prefix cache"  # the table's and the JSON's "feature" of its figures
PAGE_ROWS = 16
CHAIN_PAGES = 32
TINY = ModelConfig(n_layers=1, d_model=8, n_ff=8, n_heads=1, n_kv_heads=1, head_dim=8,
                   vocab_size=49152, context_length=1 << 20, rope_base=1e4, norm_eps=1e-5)


def fake_session(pool: KVPool, tokens: list[int]) -> Session:
    """A session that 'evaluated' tokens: pages allocated, tokens and n_past set, no math."""
    s = Session(pool=pool)
    pool.allocate([s], [len(tokens)])
    pool.commit([s], [tokens])
    return s


def _us_per_page(times_ns: list[int], pages: int) -> list[float]:
    return [t / 1e3 / pages for t in times_ns]


def cache_figures(quick: bool, n_pages: int = 10_000, seed: int = 0) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    reps = 20 if quick else 200
    n_evict = 500 if quick else 2000
    pool = KVPool(TINY, page_rows=PAGE_ROWS)
    cache = create_prefix_cache()
    chain_tokens = CHAIN_PAGES * PAGE_ROWS

    # Fill: many chains of 32 pages, each with its own first page.
    chains: list[list[int]] = []
    t0 = time.perf_counter()
    while len(cache.pages) < n_pages:
        n = min(CHAIN_PAGES, n_pages - len(cache.pages)) * PAGE_ROWS
        toks = rng.integers(0, TINY.vocab_size, n).tolist()
        s = fake_session(pool, toks)
        prefix_insert(cache, pool, s, toks, "bench")
        s.release()
        if n == chain_tokens:
            chains.append(toks)
    fill_s = time.perf_counter() - t0
    cached_pages = len(cache.pages)

    # Attach: a 32-page hit (the prompt has one token more, so the cap allows all 32 pages).
    attach_ns = []
    for i in range(reps):
        prompt = chains[i % len(chains)] + [1]
        s = Session(pool=pool)
        t = time.perf_counter_ns()
        matched = prefix_attach(cache, pool, s, prompt)
        attach_ns.append(time.perf_counter_ns() - t)
        if matched != chain_tokens:
            raise RuntimeError(f"bench attach matched {matched} tokens, expected {chain_tokens}")
        s.release()

    # Insert: a new 32-page chain into the full cache.
    insert_ns = []
    for _ in range(reps):
        toks = rng.integers(0, TINY.vocab_size, chain_tokens).tolist()
        s = fake_session(pool, toks)
        t = time.perf_counter_ns()
        added = prefix_insert(cache, pool, s, toks, "bench")
        insert_ns.append(time.perf_counter_ns() - t)
        if added != CHAIN_PAGES:
            raise RuntimeError(f"bench insert added {added} pages, expected {CHAIN_PAGES}")
        s.release()

    # Eviction: LRU leaves no session holds, deepest first, in one call.
    before = len(cache.pages)
    t = time.perf_counter_ns()
    evicted = cache.evict(n_evict)
    evict_ns = time.perf_counter_ns() - t
    if evicted != n_evict:
        raise RuntimeError(f"bench evicted {evicted} pages, expected {n_evict}")
    pool.check()

    attach = _us_per_page(attach_ns, CHAIN_PAGES)
    insert = _us_per_page(insert_ns, CHAIN_PAGES)
    evict_us = evict_ns / 1e3 / n_evict
    figures = {
        "attach_us_per_page": figure(float(np.median(attach)), "us/page", FEATURE,
                                     note=f"median of {reps} 32-page attaches, {cached_pages} pages cached"),
        "insert_us_per_page": figure(float(np.median(insert)), "us/page", FEATURE,
                                     note=f"median of {reps} new 32-page chains"),
        "evict_us_per_page": figure(evict_us, "us/page", FEATURE,
                                    note=f"evict({n_evict}) from {before} pages"),
    }
    details = {"cached_pages": cached_pages, "chains": len(cache.chains), "page_rows": PAGE_ROWS,
               "chain_pages": CHAIN_PAGES, "fill_s": fill_s, "reps": reps,
               "attach_us_per_page_mean": float(np.mean(attach)),
               "attach_us_per_page_min": float(np.min(attach)),
               "insert_us_per_page_mean": float(np.mean(insert)),
               "insert_us_per_page_min": float(np.min(insert)),
               "evicted_pages": evicted, "pages_before_evict": before}
    from .snapshot import snapshot_figures  # imports this module's pool helpers
    snap_figures, snap_details = snapshot_figures(quick, seed)
    return {**figures, **snap_figures}, {**details, **snap_details}
