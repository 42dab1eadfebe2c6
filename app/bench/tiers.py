"""Bench section "tiers": the disk tier's load-back time per page beside the prefill time it
spares, and the bytes of a float16 page beside a float32 one (docs/design.md §12)."""

from __future__ import annotations

import time

import numpy as np

import engine as dl

from .common import figure

FEATURE = "disk tier"  # the table's and the JSON's "feature" of its figures
ROWS = 16


def tier_figures(m, quick: bool, seed: int = 0) -> tuple[dict, dict]:
    n_pages = 8 if quick else 32
    rng = np.random.default_rng(seed)
    prompt = rng.integers(100, m.config.vocab_size - 100, n_pages * ROWS + 1).tolist()
    pool = dl.create_kv_pool(m, page_rows=ROWS)
    cache = dl.create_prefix_cache(max_pages=1, disk_pages=2 * n_pages)  # all but one page go to disk
    s = dl.create_session(m, pool)
    t = time.perf_counter()
    dl.eval(m, s, prompt[:-1])                       # what a miss computes: every page
    prefill_s = time.perf_counter() - t
    dl.prefix_insert(cache, pool, s, prompt[:-1], "bench")
    dl.release_kv_pages(s)
    s = dl.create_session(m, pool)
    if dl.prefix_attach(cache, pool, s, prompt) != n_pages * ROWS:
        raise RuntimeError("bench: the disk tier's pages did not attach")
    dl.release_kv_pages(s)
    loaded = cache.counters.disk_hit_pages
    load_us = cache.tier.load_seconds / loaded * 1e6
    recompute_us = prefill_s / n_pages * 1e6
    half = dl.create_kv_pool(m, page_rows=ROWS, kv_dtype="float16")
    figures = {
        "disk_load_us_per_page": figure(load_us, "us/page", FEATURE,
                                        note=f"{loaded} pages of {pool.bytes_per_page / 1024:.0f} KiB "
                                             f"loaded back from the memory-mapped tier"),
        "recompute_us_per_page": figure(recompute_us, "us/page", FEATURE,
                                        note=f"prefill of {n_pages} pages of {ROWS} tokens, per page"),
        "disk_load_recompute_ratio": figure(load_us / recompute_us, "x", FEATURE,
                                            note="load-from-disk time / recompute time, per page"),
    }
    details = {"pages": n_pages, "page_rows": ROWS, "prefill_s": prefill_s,
               "load_s": cache.tier.load_seconds, "bytes_per_page_f32": pool.bytes_per_page,
               "bytes_per_page_f16": half.bytes_per_page}
    return figures, details
