"""A long trace through the twin in bounded memory (issue #48): what the twin's scheduler, pool,
cache and books retain stays under fixed counts however many requests pass. Deterministic: counts,
no timing. Also the engine's timeline ring that bounds a long-running server."""

from __future__ import annotations

import numpy as np
import pytest

from app.replay.stepcost import StepCost
from app.replay.twin import KEPT_RECORDS, Predicted, Twin, block_tokens
from engine.metrics import Timeline, TimelineRow
from engine.stream import SchedulerSettings

COST = StepCost(c0=0.004, c_prefill=1e-5, c_decode=5e-4)
POOL = 96   # pages of 8 rows: a few requests' worth, so the cache evicts all along
REQUESTS = 1200


def _evictable_by_definition(cache) -> int:
    """The cache's evictable pages as `num_evictable` defines them, over every cached page:
    a page no session holds and no pin keeps, with no such page below it (children first)."""
    blocked: set[int] = set()
    for e in sorted(cache.pages.values(), key=lambda e: -e.depth):
        if e.key in blocked or cache.pool.refcount_of(e.page) != 1 or cache.chains[e.chain_id].pinned:
            blocked.add(e.key)
            if e.parent is not None:
                blocked.add(e.parent)
    return len(cache.pages) - len(blocked)


def test_a_long_trace_keeps_the_twins_memory_under_fixed_counts():
    rows = 8
    twin = Twin(COST, SchedulerSettings(page_rows=rows, pool_pages=POOL, max_streams=4,
                                        chunk_tokens=64, max_queue=2**31 - 1))
    rng = np.random.default_rng(7)
    done: list[int] = []
    twin.on_done = lambda p: done.append(p.index)
    peak = {"records": 0, "tokens": 0, "timeline": 0, "live": 0, "capacity": 0, "cached": 0}
    t = 0.0
    for i in range(REQUESTS):
        t += float(rng.exponential(0.05))
        twin.advance(t)
        shared = [int(rng.integers(0, 6))]            # one of six shared first blocks
        own = [10_000 + i * 4 + k for k in range(int(rng.integers(1, 4)))]
        prompt = [tok for h in shared + own for tok in block_tokens(h, rows, 32, 256)]
        twin.submit(Predicted(i, t, len(prompt), int(rng.integers(1, 6))), prompt)
        s = twin.scheduler
        for name, n in (("records", len(s.records())), ("tokens", len(s.ended_tokens())),
                        ("timeline", len(s.timeline)), ("live", len(twin._live)),
                        ("capacity", s.pool.capacity), ("cached", len(s.cache.pages))):
            peak[name] = max(peak[name], n)
        if i % 200 == 199:  # the walk from the held pages gives the definition's count
            assert s.cache.num_evictable() == _evictable_by_definition(s.cache)
    twin.drain()
    print(f"{REQUESTS} requests, {twin.steps} passes; peak retained: {peak}")
    assert sorted(done) == list(range(REQUESTS))      # every request ran to its end
    assert twin.scheduler.cache.counters.evicted_pages > 0   # the pool was full: eviction ran
    in_flight = REQUESTS // 4  # a generous bound on requests queued or running at once at this rate
    assert peak["records"] <= KEPT_RECORDS + in_flight
    assert peak["tokens"] <= KEPT_RECORDS
    assert peak["timeline"] == 0                      # the twin builds no timeline row per pass
    assert peak["live"] <= in_flight
    assert peak["capacity"] == POOL and peak["cached"] <= POOL
    assert twin.load == 0 and twin.kv_blocks == 0 and not twin._live


def _row(step: int) -> TimelineRow:
    return TimelineRow(step, 0.0, *[0] * 16, 0.0)


def test_the_timeline_keeps_the_last_steps_only():
    """A server's scheduler runs for days: its timeline is a ring of the last `keep` steps."""
    tl = Timeline(keep=32)
    for step in range(1, 1001):
        tl.append(_row(step))
        assert len(tl) <= 32 + 32 // 16
    steps = [r.step for r in tl.rows]
    assert steps == list(range(1001 - len(steps), 1001)) and len(steps) >= 32
    assert Timeline(keep=0).keep == 0
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="keeps an integer >= 0"):
            Timeline(keep=bad)


def test_the_sampler_reads_the_same_recent_tokens_without_copying_the_history():
    """A repeat penalty reads the last n tokens of prompt + answer; `Stream.recent` gives exactly
    those (the scheduler no longer builds prompt + answer per sampled token)."""
    from engine.metrics import RequestRecord
    from engine.sampler import Sampler
    from engine.stream import Stream
    s = Stream(record=RequestRecord(1, "", None, "", 5), prompt=[1, 2, 3, 4, 5], sampler=Sampler(),
               max_new_tokens=8, stop_ids=frozenset(), text_stream=None, arrival=0.0, positions=13)
    for gen in ([], [6], [6, 7, 8], [6, 7, 8, 9, 10, 11, 12]):
        s.generated = gen
        for n in range(0, 15):
            want = (s.prompt + gen)[-n:] if n else []
            assert s.recent(n) == want, (gen, n)
