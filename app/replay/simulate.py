"""Replay a trace through the engine's own page manager and prefix cache, with no K/V storage.

Every request makes the scheduler's calls: attach its cached prefix to a fresh
session (the match capped one token short of the prompt), take pages for the
rest, insert its full pages, and at its end insert what its session held and
release it (the cache evicts down to its budget as pages become free).

Hash-id traces (docs/design.md §10) run the same calls on a BlockManager of one row per
page and an id-keyed cache: a page is one block keyed by its hash id, and the
session's "tokens" are the block ids. Capping the ids one short,
ceil(L / block) - 1, is (L - 1) // block blocks; the insert covers the full
blocks, L // block.

Token traces replay at any page size. A trace recorded by the scheduler carries
when each request was admitted and finished; the replay interleaves those
events in the same order, so at the session's own settings it reproduces the
session's hits exactly.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import time

from engine.api import prefix_insert
from engine.block_manager import BlockManager, Session
from engine.disk_tier import DiskTier
from engine.prefix_cache import PrefixCache
from engine.token_parts import TokenParts, add_parts

from .results import OverTime, ReplayConfig, ReplayResult
from .trace import TraceError, TraceRequest, TraceSource

# Pages the replay's ever-seen index remembers (docs/design.md §15): more than the engine's, so
# a trace's `evicted` reaches back over a quarter of a million pages (the shipped Mooncake trace
# has 182,790 distinct blocks); past it a page counts as `new`.
REPLAY_SEEN_PAGES = 1 << 18


def replay(source: TraceSource, config: ReplayConfig) -> ReplayResult:
    """Run the whole trace at one configuration; return its hit figures."""
    t0 = time.perf_counter()
    if source.hashed:
        if config.page_rows not in (None, source.block_size):
            raise ValueError(f"a hash-id trace replays at its own block size ({source.block_size}); "
                             f"page size {config.page_rows} needs a token trace")
        run = _Replay(config, rows=source.block_size, hashed=True)
    else:
        rows = config.page_rows or source.header.page_rows
        if rows is None:
            raise ValueError(f"{source.path}: the trace has no page size of its own; give one")
        run = _Replay(config, rows=rows, hashed=False)
    # The cached pages hold no reference cycles, but hundreds of thousands of them make
    # every generation-2 collection walk them all: a quarter of the run, for nothing.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        run.feed(source)
    finally:
        if was_enabled:
            gc.enable()
    res = run.result
    res.evicted = run.cache.counters.evicted_pages
    res.blocks_from_disk = run.cache.counters.disk_hit_pages
    res.cached_pages = len(run.cache.pages)
    res.over_time = run.over_time.series()
    res.note_skipped(source)
    res.seconds = time.perf_counter() - t0
    return res


class _Replay:
    """A bare page manager, a prefix cache at one budget and policy, and the requests in flight."""

    def __init__(self, config: ReplayConfig, rows: int, hashed: bool):
        self.rows, self.hashed = rows, hashed
        self.pages = BlockManager(page_rows=1 if hashed else rows)
        tier = DiskTier(config.disk_budget) if config.disk_budget else None  # keys only: no K/V here
        self.cache = PrefixCache(max_pages=config.budget or 0, policy=config.policy, id_keys=hashed,
                                 tier=tier, seen_pages=REPLAY_SEEN_PAGES)
        self.cache.bind(self.pages)
        self.result = ReplayResult(page_rows=rows, budget=config.budget, policy=config.policy,
                                   disk_budget=config.disk_budget, seen_pages=REPLAY_SEEN_PAGES)
        self.last_parts = TokenParts()  # the last admitted request's (clusters carve `routed` from it)
        self.over_time = OverTime()
        self.finishing: list = []   # (finish_s, order, session, request) of admitted requests
        self.order = itertools.count()

    def feed(self, source: TraceSource) -> None:
        last = None
        for i, r in enumerate(source):
            if r.admitted_s is None and r.finish_s is not None:
                continue  # it never ran (cancelled in the queue): no attach, no donation
            if r.admitted_s is None:  # untimed: each request ends before the next starts
                self.finish(self.admit(r), r)
                continue
            if last is not None and r.admitted_s < last:
                raise TraceError(f"{source.path}: request {i + 1} was admitted before request {i}; "
                                 f"a timed trace lists requests in admission order")
            last = r.admitted_s
            self.finish_until(r.admitted_s)
            heapq.heappush(self.finishing, (r.finish_s or r.admitted_s, next(self.order), self.admit(r), r))
        self.finish_until(float("inf"))

    def admit(self, r: TraceRequest) -> Session:
        """Attach, compute the rest, insert the prompt's full pages; count the hit and where
        every prompt token went (the operator's view: another namespace's pages are `isolated`)."""
        pages, cache = self.pages, self.cache
        if self.hashed:
            prompt, full = r.hash_ids, r.hash_ids[:r.input_length // self.rows]
        else:
            prompt = full = r.prompt
        s = Session(pages)
        cache.actor = self.result.requests + 1   # the trace's request number
        m, account, _ = cache.attach_accounted(pages, s, prompt, r.namespace)
        parts = account.parts.scaled(self.rows, r.input_length) if self.hashed else account.parts
        add_parts(self.result.parts, parts)
        self.last_parts = parts
        pages.allocate([s], [len(prompt) - m])
        pages.commit([s], [prompt[m:]])
        prefix_insert(cache, pages, s, full, namespace=r.namespace)
        blocks, saved = (m, m * self.rows) if self.hashed else (m // self.rows, m)
        res = self.result
        res.requests += 1
        res.input_tokens += r.input_length
        if blocks:
            res.hits += 1
            res.blocks_hit += blocks
            res.tokens_saved += saved
        self.over_time.add(r.arrival_s, saved, r.input_length)
        return s

    def finish(self, s: Session, r: TraceRequest) -> None:
        """Donate what the session held at its end (prompt, answer, closing tokens); release it."""
        donated, n = r.donated, s.n_past
        if donated is not None and len(donated) > n and donated[:n] == self.pages.tokens(s):
            self.pages.allocate([s], [len(donated) - n])
            self.pages.commit([s], [donated[n:]])
            prefix_insert(self.cache, self.pages, s, donated, namespace=r.namespace)
        s.release()

    def finish_until(self, t: float) -> None:
        while self.finishing and self.finishing[0][0] <= t:
            _, _, s, r = heapq.heappop(self.finishing)
            self.finish(s, r)
