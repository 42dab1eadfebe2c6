"""Admission and planning rules of the scheduler: who may start, and what one pass computes.

Pure functions over streams, the pool and the cache, so the rules read apart from the loop.
"""

from __future__ import annotations

import numpy as np

from .block_manager import BlockManager, attach_cap
from .prefix_cache import PrefixCache, prefix_probe
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


def must_wait(s: Stream, streams: list[Stream], cache: PrefixCache, page_rows: int) -> bool:
    """True while another stream is computing pages of this prompt that the cache lacks
    (a prompt prefilling, or a finished turn's closing tokens): the request shares them
    once they are published instead of computing them twice."""
    cached = prefix_probe(cache, s.prompt, s.record.namespace).matched_pages
    for other in streams:
        if other.record.namespace != s.record.namespace or other.session is None:
            continue
        target = other.target()
        if other.session.n_past < len(target):
            shared = min(common_prefix(s.prompt, target) // page_rows, attach_cap(len(s.prompt), page_rows))
            if shared > cached:
                return True
    return False


def plan_prefill(active: list[Stream], leaving: set[int],
                 chunk_tokens: int) -> list[tuple[Stream, list[int]]]:
    """This step's prefill chunk: up to `chunk_tokens` prompt tokens, shortest remainder first.

    Shortest first lets the short tails of cache hits finish (and so give their first
    token) in one step instead of queueing behind a long miss; the long prompt still
    gets whatever budget they leave.
    """
    waiting = [s for s in active if s.prefilling and s.id not in leaving]
    waiting.sort(key=lambda s: len(s.prompt) - s.session.n_past)  # stable: ties keep admission order
    budget, plan = chunk_tokens, []
    for s in waiting:
        if budget == 0:
            break
        n = s.session.n_past
        piece = s.prompt[n:n + budget]
        plan.append((s, piece))
        budget -= len(piece)
    return plan
