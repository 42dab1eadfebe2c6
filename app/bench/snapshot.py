"""Bench figure "snapshot_16k_1k_ratio": a page-map snapshot of a 16,384-page pool against a
1,024-page one (snapshots must grow with the pages, not their square).

No model math: a tiny-config pool, three quarters of it cached chains and the rest held by
live sessions, read through the same SnapshotMaker the desktop app's chart refresh uses.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import numpy as np

from engine import create_prefix_cache, prefix_insert
from engine.kv_pool import KVPool
from engine.metrics import Timeline, page_states
from engine.snapshot import SnapshotMaker

from .cache import PAGE_ROWS, TINY, fake_session
from .common import figure, target

FEATURE = "snapshots"  # the table's and the JSON's "feature" of its figures
CHAIN_PAGES = 16


class _Words:
    """Decodes token ids as numbers: the snapshot's own cost, not a tokenizer's."""

    def decode(self, ids) -> str:
        return " ".join(map(str, ids))


@dataclass
class _Model:
    config: object = TINY
    tokenizer: _Words = field(default_factory=_Words)


@dataclass
class _Stream:
    id: int
    session: object


class _Engine:
    """What SnapshotMaker.take reads of a scheduler, over a real pool and cache."""

    def __init__(self, n_pages: int, rng: np.random.Generator):
        self.model = _Model()
        self.pool = KVPool(TINY, page_rows=PAGE_ROWS, max_pages=n_pages)
        self.cache = create_prefix_cache()
        self.cache.bind(self.pool)
        self.timeline, self._streams = Timeline(), []
        n = CHAIN_PAGES * PAGE_ROWS
        while len(self.cache.pages) + CHAIN_PAGES <= n_pages * 3 // 4:
            toks = rng.integers(0, TINY.vocab_size, n).tolist()
            s = fake_session(self.pool, toks)
            prefix_insert(self.cache, self.pool, s, toks, "bench")
            s.release()
        while self.pool.num_free_pages >= CHAIN_PAGES:
            s = fake_session(self.pool, rng.integers(0, TINY.vocab_size, n).tolist())
            self._streams.append(_Stream(len(self._streams) + 1, s))

    def page_states(self) -> np.ndarray:
        return page_states(self.pool, self.cache)

    def streams(self) -> list:
        return self._streams

    def records(self) -> list:
        return []

    def prefill_rate(self) -> float:
        return 0.0

    def seconds_saved(self) -> float:
        return 0.0


def _snapshot_s(n_pages: int, reps: int, rng: np.random.Generator) -> float:
    """The fastest of `reps` refreshes: the snapshot's own cost, without the other processes'
    noise on a shared machine or a garbage collection walking the whole heap mid-way."""
    eng = _Engine(n_pages, rng)
    maker = SnapshotMaker()
    maker.take(eng)  # the first decodes every page's text once; a refresh reuses it
    times = []
    for _ in range(reps):
        gc.collect()
        gc.disable()
        try:
            t = time.perf_counter()
            snap = maker.take(eng)
            times.append(time.perf_counter() - t)
            del snap  # freed by its reader (the UI thread) in the app, not by the engine
        finally:
            gc.enable()
    return float(np.min(times))


def snapshot_figures(quick: bool, seed: int = 0) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    reps = 5 if quick else 15
    small, large = _snapshot_s(1024, reps, rng), _snapshot_s(16384, reps, rng)
    figures = {"snapshot_16k_1k_ratio": figure(
        large / small, "x", FEATURE, **target("snapshot_16k_1k_ratio"),
        note=f"fastest of {reps} snapshots: 16,384 pages {large * 1e3:.1f} ms, 1,024 pages "
             f"{small * 1e3:.2f} ms (16x the pages; linear is ~16)")}
    return figures, {"snapshot_1k_ms": small * 1e3, "snapshot_16k_ms": large * 1e3}
