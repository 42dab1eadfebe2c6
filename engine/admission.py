"""Admission and planning rules of the scheduler: whether a request's pages can be had, and
what one pass prefills. Pure functions over streams, the pool and the cache, so the rules read
apart from the loop; sharing pages another stream is computing is engine/lending.py's.
"""

from __future__ import annotations

from .block_manager import BlockManager
from .lending import may_join, unsettled
from .prefix_cache import PrefixCache
from .stream import Stream


def can_take(pool: BlockManager, cache: PrefixCache, pages: int) -> bool:
    """True when `pages` can be allocated now: free pages plus what the cache can give back.

    Counted before attaching a prefix: attaching m cached pages removes at most m from
    the evictable count and the same m from what the request still has to allocate.
    """
    if pool.max_pages is None:
        return True
    return pool.num_free_pages + cache.num_evictable() >= pages


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
        if not may_join(s, reach):
            continue
        n = s.session.n_past
        piece = s.prompt[n:n + budget]
        plan.append((s, piece))
        reach[s.id] = n + len(piece)
        budget -= len(piece)
    return plan
