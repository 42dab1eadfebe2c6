"""Admission and planning rules of the scheduler: who may start, and what one pass computes.

Pure functions over streams, the pool and the cache, so the rules read apart from the loop.
"""

from __future__ import annotations

import numpy as np

from .api import prefix_probe
from .block_manager import BlockManager, attach_cap
from .prefix_cache import PrefixCache
from .stream import Stream


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two token lists share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def can_take(pool: BlockManager, cache: PrefixCache, pages: int) -> bool:
    """True when `pages` can be allocated now: free pages plus what the cache can give back.

    Counted before attaching a prefix: attaching m cached pages removes at most m from
    the evictable count and the same m from what the request still has to allocate.
    """
    if pool.max_pages is None:
        return True
    return pool.num_free_pages + cache.num_evictable() >= pages


def computing(s: Stream, streams: list[Stream], cache: PrefixCache,
              page_rows: int) -> tuple[Stream, int] | None:
    """(the stream, its pages this prompt shares) while another stream is computing pages of
    this prompt that the cache lacks (a prompt prefilling, or a finished turn's closing tokens);
    None when none is. The request shares those pages instead of computing them twice."""
    cached = prefix_probe(cache, s.prompt, s.record.namespace).matched_pages
    for other in streams:
        if other.record.namespace != s.record.namespace or other.session is None:
            continue
        target = other.target()
        if other.session.n_past < len(target):
            shared = min(common_prefix(s.prompt, target) // page_rows, attach_cap(len(s.prompt), page_rows))
            if shared > cached:
                return other, shared
    return None


def can_lend(owner: Stream, pages: int, page_rows: int, chunk_tokens: int) -> bool:
    """A stream prefilling its own prompt lends pages it has yet to write when its next pass
    can write them all, so the borrower joins that pass instead of waiting for the next one
    (docs/design.md §4). A closing turn, a stream leaving, or a borrower itself does not lend."""
    return (owner.prefilling and owner.cancel_requested is None and owner.lender is None
            and pages * page_rows - owner.session.n_past <= chunk_tokens)


def unsettled(s: Stream) -> bool:
    """True while pages this stream borrowed are unwritten: it may read them in their pass only."""
    return s.lender is not None and s.lender.session.n_past < s.borrowed


def settle_borrowers(active: list[Stream], pool: BlockManager,
                     cache: PrefixCache) -> tuple[int, list[Stream]]:
    """Borrowers whose pages are written now read them as any and count as the cache hits they
    would have been had they waited: (tokens they saved, those whose lender is leaving before
    writing them, which start over from the queue)."""
    saved, orphans = 0, []
    for s in [s for s in active if s.lender is not None]:
        if not unsettled(s):
            s.lender = None
            n_pages = s.borrowed // pool.page_rows
            page = pool.table(s.session)[n_pages - 1]
            s.record.chain_hit = cache.chain_of(page)
            cache.count_query()  # the hit it would have been had it waited
            cache.count_hit(s.record.chain_hit, n_pages, s.borrowed)
            saved += s.borrowed
        elif s.lender.cancel_requested and not s.cancel_requested:
            orphans.append(s)
    return saved, orphans


def plan_prefill(active: list[Stream], leaving: set[int],
                 chunk_tokens: int) -> list[tuple[Stream, list[int]]]:
    """This step's prefill chunk: up to `chunk_tokens` prompt tokens, shortest remainder first.

    Shortest first lets the short tails of cache hits finish (and so give their first
    token) in one step instead of queueing behind a long miss; the long prompt still
    gets whatever budget they leave.
    """
    waiting = [s for s in active if s.prefilling and s.id not in leaving]
    waiting.sort(key=lambda s: len(s.prompt) - s.session.n_past)  # stable: ties keep admission order
    budget, plan, reach = chunk_tokens, [], {}
    # a borrower goes after the others, and only into a pass its lender's piece writes the pages in
    for s in [s for s in waiting if not unsettled(s)] + [s for s in waiting if unsettled(s)]:
        if budget == 0:
            break
        if unsettled(s) and reach.get(s.lender.id, 0) < s.borrowed:
            continue
        n = s.session.n_past
        piece = s.prompt[n:n + budget]
        plan.append((s, piece))
        reach[s.id] = n + len(piece)
        budget -= len(piece)
    return plan
