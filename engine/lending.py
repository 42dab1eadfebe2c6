"""Lending: a prompt whose uncached prefix another stream is computing shares those pages
instead of computing them twice, joining the pass that writes them (docs/design.md §4).

The whole life of a loan reads here, in order: who is computing pages of this prompt
(`in_flight_share`), whether that stream may lend them now (`can_lend`), the loan itself
(`lend`, a `Loan` on the borrower), which pass a borrower may join (`unsettled`, `may_join`),
and, after each pass, settling borrowers whose pages are written (counted as the cache hits
they would have been had they waited) and sending back to the queue those whose lender left
before writing them (`settle_borrowers`). The pages' side, a write guard that lets only the
owner write a lent page, is `BlockManager.lend`; the scheduler calls these functions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .block_manager import BlockManager, attach_cap
from .prefix_cache import PrefixCache
from .token_parts import Account

if TYPE_CHECKING:
    from .stream import Stream


@dataclass
class Loan:
    """A borrower's loan: the stream writing the pages, and how many positions it shares."""

    lender: Stream
    positions: int


class InFlightShare(NamedTuple):
    """A stream computing pages of another prompt that the cache lacks, and how many of its
    pages that prompt shares."""

    owner: Stream
    pages: int
    cached: int = 0   # of those pages, the ones the cache holds (the owner attached them)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two token lists share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def in_flight_share(s: Stream, streams: list[Stream], cache: PrefixCache,
                    page_rows: int) -> InFlightShare | None:
    """The stream computing pages of `s`'s prompt that the cache lacks (a prompt prefilling, or a
    finished turn's closing tokens), and how many pages `s` shares with it; None when none is."""
    cached = cache.probe(s.prompt, s.record.namespace).matched_pages
    for other in streams:
        if other.record.namespace != s.record.namespace or other.session is None:
            continue
        target = other.target()
        if other.session.n_past < len(target):
            shared = min(common_prefix(s.prompt, target) // page_rows, attach_cap(len(s.prompt), page_rows))
            if shared > cached:
                return InFlightShare(other, shared, cached)
    return None


def can_lend(share: InFlightShare, page_rows: int, chunk_tokens: int) -> bool:
    """A stream prefilling its own prompt lends pages it has yet to write when its next pass
    can write them all, so the borrower joins that pass instead of waiting for the next one.
    A closing turn, a stream leaving, or a borrower itself does not lend."""
    owner = share.owner
    return (owner.prefilling and owner.cancel_requested is None and owner.loan is None
            and share.pages * page_rows - owner.session.n_past <= chunk_tokens)


def lend(pool: BlockManager, share: InFlightShare, borrower: Stream, page_rows: int) -> None:
    """Give the borrower's fresh session the owner's shared pages, written or not."""
    borrower.loan = Loan(share.owner, share.pages * page_rows)
    pool.lend(share.owner.session, borrower.session, share.pages, borrower.prompt[:borrower.loan.positions])
    borrower.record.n_cached = borrower.loan.positions  # counted as saved once the pages are written


def account_loan(cache: PrefixCache, borrower: Stream, share: InFlightShare) -> tuple[Account, Account]:
    """Where a borrower's prompt tokens went (docs/design.md §15): the cache's pages among those
    lent are `cached`, the others `lent`, and the lender's prompt competes with every earlier
    one for where the borrower's departs. (The operator's account, the tenant's.)"""
    shared = common_prefix(borrower.prompt, share.owner.target())
    return cache.account(borrower.prompt, borrower.record.namespace, share.cached, 0,
                         share.pages - share.cached, None, (shared, share.owner.id))


def unsettled(s: Stream) -> bool:
    """True while pages this stream borrowed are unwritten: it may read them in their pass only."""
    return s.loan is not None and s.loan.lender.session.n_past < s.loan.positions


def may_join(s: Stream, reach: dict[int, int]) -> bool:
    """Whether a stream may prefill in a pass whose planned pieces reach `reach[stream id]`
    positions: a settled one always, an unsettled borrower only when its lender's piece writes
    the pages it borrowed in that pass."""
    return not unsettled(s) or reach.get(s.loan.lender.id, 0) >= s.loan.positions


def settle_borrowers(active: list[Stream], queue: deque[Stream], pool: BlockManager,
                     cache: PrefixCache) -> int:
    """After a pass: borrowers whose pages are written now read them as any and count as the
    cache hits they would have been had they waited; those whose lender is leaving before
    writing them leave `active` for the front of `queue`, to start over. Returns the tokens saved."""
    saved, orphans = 0, []
    for s in [s for s in active if s.loan is not None]:
        if not unsettled(s):
            n_pages = s.loan.positions // pool.page_rows
            page = pool.table(s.session)[n_pages - 1]
            s.record.chain_hit = cache.chain_of(page)
            cache.count_query()
            cache.count_hit(s.record.chain_hit, n_pages, s.loan.positions)
            saved += s.loan.positions
            s.loan = None
        elif s.loan.lender.cancel_requested and not s.cancel_requested:
            orphans.append(s)
    for s in orphans:
        active.remove(s)
        pool.free_session(s.session)
        s.session, s.loan, s.record.n_cached = None, None, 0
        queue.appendleft(s)
    return saved
