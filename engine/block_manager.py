"""The pages: one owner for page ids, reference counts, the free list and every session's
page table and tokens (docs/design.md §1, nano-vllm's BlockManager).

The manager never touches tensors: `KVPool` (engine/kv_pool.py) adds the K/V arrays, and
the trace replay drives a bare manager with no storage at all. Everything here is plain
lists and dicts, O(1) per page. A bounded manager that runs out of pages asks its evictor
(the prefix cache bound to it) for pages; releasing a session goes through it so a cache
over its budget gives pages back at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from .errors import PoolExhausted

INITIAL_PAGES = 64
_pool_ids = itertools.count(1)
_session_ids = itertools.count(1)


@dataclass
class _Seq:
    """A session's state, written only by its BlockManager."""

    pages: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    released: bool = False


@dataclass(frozen=True)
class SeqSlots:
    """One session's part of a forward pass: its pages (covering the new tokens) and start."""

    page_table: list[int]
    n_past: int


def pages_for(n_positions: int, page_rows: int) -> int:
    """Pages that hold `n_positions` positions: the one definition of "pages needed"."""
    return -(-n_positions // page_rows)


def attach_cap(n_prompt: int, page_rows: int) -> int:
    """Most pages a prompt of `n_prompt` tokens may take from the cache: one token short of the
    prompt, so the model always evaluates at least one token to make logits (docs/design.md §3)."""
    return max(0, (n_prompt - 1) // page_rows)


class Session:
    """One sequence's handle: `.page_table`, `.tokens`, `.n_past` read its manager's record."""

    def __init__(self, pool: BlockManager):
        self.pool = pool
        self.id = next(_session_ids)
        self._seq = pool.open(self)

    @property
    def page_table(self) -> list[int]:
        return list(self._seq.pages)

    @property
    def tokens(self) -> list[int]:
        return list(self._seq.tokens)

    @property
    def n_past(self) -> int:
        """Positions evaluated (or attached from the cache): derived from the tokens."""
        return len(self._seq.tokens)

    @property
    def released(self) -> bool:
        return self._seq.released

    def release(self) -> None:
        """Hand every page back; the session cannot be used after."""
        self.pool.free_session(self)

    def __repr__(self) -> str:
        return f"Session(id={self.id}, n_past={self.n_past}, pages={len(self._seq.pages)})"


class BlockManager:
    """Reference-counted page ids of `page_rows` positions; grows by doubling or is bounded.

    A page is free when its count is 0. Sessions and the prefix cache each hold one
    reference on a page they use; sharing is by reference only.
    """

    def __init__(self, page_rows: int = 16, max_pages: int | None = None):
        if not isinstance(page_rows, int) or isinstance(page_rows, bool) or page_rows < 1:
            raise ValueError(f"page_rows must be a positive integer, got {page_rows!r}")
        if max_pages is not None and (not isinstance(max_pages, int) or max_pages < 1):
            raise ValueError(f"max_pages must be a positive integer or None, got {max_pages!r}")
        self.id = next(_pool_ids)
        self.page_rows = page_rows
        self.max_pages = max_pages
        start = max_pages if max_pages is not None else INITIAL_PAGES
        self.refs: list[int] = [0] * start
        self._refcount: np.ndarray | None = None   # `refcount`'s array, until a count changes
        self.version = 0   # bumped by every change of a count or of the pages: readers' memo key
        self._free: list[int] = list(range(start - 1, -1, -1))  # pop() gives the lowest id
        self._seqs: dict[int, _Seq] = {}    # live sessions' records, by session id
        self.evictor: Callable[[int], int] | None = None  # see `bind_evictor`
        self.lent: set[int] = set()  # shared before their owner wrote them: see `lend`

    # counts -----------------------------------------------------------
    @property
    def capacity(self) -> int:
        return len(self.refs)

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return len(self.refs) - len(self._free)

    @property
    def refcount(self) -> np.ndarray:
        """Every page's reference count as a read-only int64 array (charts, checks and tests).

        Built once per change of any count, not per read: a snapshot reads it per page."""
        arr = self._refcount
        if arr is None:
            arr = self._refcount = np.array(self.refs, dtype=np.int64)
            arr.flags.writeable = False
        return arr

    def refcount_of(self, page: int) -> int:
        """One page's reference count."""
        return self.refs[page]

    # pages ------------------------------------------------------------
    def _grow(self) -> None:
        old = len(self.refs)
        self.refs.extend([0] * old)
        self._refcount = None
        self.version += 1
        self._free = list(range(2 * old - 1, old - 1, -1)) + self._free
        self._on_grow(old, 2 * old)

    def _on_grow(self, old: int, new: int) -> None:
        """Storage hook: a KVPool extends its K/V arrays here."""

    def alloc(self) -> int:
        """A free page with reference count 1; grows, asks the evictor for one, or raises."""
        if not self._free:
            if self.max_pages is None:
                self._grow()
            elif self.evictor is not None:
                self.evictor(1)
        if not self._free:
            raise PoolExhausted(
                f"KV pool is full: all {self.capacity} pages are in use by sessions "
                f"and the prefix cache has nothing it can evict")
        page = self._free.pop()
        self.refs[page] = 1
        self._refcount = None
        self.version += 1
        return page

    def retain(self, page: int) -> None:
        """Take one more reference on a page in use."""
        if self.refs[page] <= 0:
            raise ValueError(f"page {page} is free; cannot take a reference on it")
        self.refs[page] += 1
        self._refcount = None
        self.version += 1

    def release(self, page: int) -> None:
        """Drop one reference; the page returns to the free list at 0."""
        if self.refs[page] <= 0:
            raise ValueError(f"page {page} is already free; released twice")
        self.refs[page] -= 1
        self._refcount = None
        self.version += 1
        if self.refs[page] == 0:
            self._free.append(page)
            self.lent.discard(page)

    def bind_evictor(self, evictor: Callable[[int], int]) -> None:
        """Bind, once, what gives pages back (the prefix cache's `give_back`): `evictor(n)` frees
        up to n pages when a bounded manager has none free; `evictor(0)`, after a session's
        release, gives back what is over the cache's budget. Each returns how many it freed."""
        if self.evictor is not None and self.evictor != evictor:
            raise ValueError("this KV pool already has a prefix cache; one pool serves one cache")
        self.evictor = evictor

    # sessions ---------------------------------------------------------
    def open(self, s: Session) -> _Seq:
        """The record of a new session (its constructor calls this; the manager writes it)."""
        seq = self._seqs[s.id] = _Seq()
        return seq

    def _live(self, s: Session) -> _Seq:
        if s.pool is not self:
            raise ValueError(f"session {s.id} belongs to another KV pool")
        seq = self._seqs.get(s.id)
        if seq is None:
            raise ValueError(f"session {s.id} was released; create a new session")
        return seq

    def table(self, s: Session) -> list[int]:
        """A live session's page table itself (read-only for callers; no copy)."""
        return self._seqs[s.id].pages

    def tokens(self, s: Session) -> list[int]:
        """A live session's evaluated tokens themselves (read-only for callers; no copy)."""
        return self._seqs[s.id].tokens

    def session_pages(self) -> Iterator[int]:
        """Every live session's pages (a page two sessions share comes twice)."""
        return (page for seq in self._seqs.values() for page in seq.pages)

    def reserve(self, s: Session, n_positions: int) -> None:
        """Allocate pages until the session's table covers `n_positions`; all or nothing."""
        seq = self._live(s)
        need = pages_for(n_positions, self.page_rows)
        start = len(seq.pages)
        try:
            while len(seq.pages) < need:
                seq.pages.append(self.alloc())
        except PoolExhausted:
            for page in seq.pages[start:]:
                self.release(page)
            del seq.pages[start:]
            raise

    def allocate(self, sessions: list[Session], counts: list[int]) -> list[SeqSlots]:
        """Pages for `counts[i]` new tokens of each session (all or nothing), checked writable."""
        taken: list[tuple[Session, int]] = []
        try:
            for s, n in zip(sessions, counts):
                taken.append((s, len(self._live(s).pages)))
                self.reserve(s, s.n_past + n)
        except PoolExhausted:
            for s, had in taken:
                seq = self._seqs[s.id]
                for page in seq.pages[had:]:
                    self.release(page)
                del seq.pages[had:]
            raise
        rows = self.page_rows
        for s, n in zip(sessions, counts):
            pages = self._seqs[s.id].pages
            start = s.n_past
            for i in range(start // rows, pages_for(start + n, rows)):
                if self.refs[pages[i]] != 1 and pages[i] not in self.lent:
                    # The one shared-page write guard: a shared page is immutable, and
                    # writing into it would corrupt every holder (a lent page is written by its owner).
                    raise RuntimeError(f"refusing to write K/V into shared or free page {pages[i]} "
                                       f"of session {s.id}")
        return [SeqSlots(list(self._seqs[s.id].pages), s.n_past) for s in sessions]

    def commit(self, sessions: list[Session], token_lists: list[list[int]]) -> None:
        """Record tokens whose K/V the forward pass wrote into the allocated slots."""
        for s, toks in zip(sessions, token_lists):
            seq = self._live(s)
            if pages_for(len(seq.tokens) + len(toks), self.page_rows) > len(seq.pages):
                raise RuntimeError(f"session {s.id}: committing tokens past its allocated pages")
            seq.tokens.extend(int(t) for t in toks)
            if self.lent:  # written now: immutable like any shared page
                self.lent.difference_update(seq.pages[:len(seq.tokens) // self.page_rows])

    def rollback(self, s: Session, n_tokens: int) -> None:
        """Forget the session's last `n_tokens` evaluated tokens (rejected speculative drafts).

        Their pages stay with the session (reserved at admission); the next tokens overwrite
        those rows. Only private pages can lose tokens: a cached or shared page is immutable.
        """
        seq = self._live(s)
        if not 0 <= n_tokens <= len(seq.tokens):
            raise ValueError(f"session {s.id}: cannot roll back {n_tokens} of {len(seq.tokens)} tokens")
        keep = len(seq.tokens) - n_tokens
        rows = self.page_rows
        for page in seq.pages[keep // rows:pages_for(len(seq.tokens), rows)]:
            if self.refs[page] != 1:
                raise RuntimeError(f"session {s.id}: rolling back into shared or cached page {page}")
        del seq.tokens[keep:]

    def check_fresh(self, s: Session) -> None:
        """Raise unless the session is live, of this pool, and has no page and no token."""
        seq = self._live(s)
        if seq.tokens or seq.pages:
            raise ValueError(
                f"prefix_attach needs a fresh session (n_past 0, no pages); session {s.id} has "
                f"n_past {len(seq.tokens)} and {len(seq.pages)} pages")

    def attach(self, s: Session, pages: list[int], tokens: list[int]) -> None:
        """Give a fresh session cached pages (one reference each) holding `tokens`."""
        seq = self._live(s)
        self.check_fresh(s)
        if len(tokens) != len(pages) * self.page_rows:
            raise ValueError(f"attach: {len(tokens)} tokens do not fill {len(pages)} pages")
        for page in pages:
            self.retain(page)
        seq.pages.extend(pages)
        seq.tokens.extend(int(t) for t in tokens)

    def lend(self, owner: Session, borrower: Session, n_pages: int, tokens: list[int]) -> None:
        """Share the owner's first `n_pages` with a fresh session before the owner has written
        them all (docs/design.md §4): the owner's pass writes them, the write guard lets it, and
        the scheduler lets the borrower read them only in that pass or later."""
        seq = self._live(owner)
        pages = seq.pages[:n_pages]
        self.lent.update(pages[len(seq.tokens) // self.page_rows:])
        self.attach(borrower, pages, tokens)

    def free_session(self, s: Session) -> None:
        """Release every page of the session; a cache over its budget gives pages back now."""
        if s.pool is not self:
            raise ValueError(f"session {s.id} belongs to another KV pool")
        seq = self._seqs.get(s.id)
        if seq is None:
            raise ValueError(f"session {s.id} was already released")
        # last page first: the next session then pops them in ascending order, side by side,
        # and attention reads side-by-side pages as a view instead of copying them per layer
        for page in reversed(seq.pages):
            self.release(page)
        seq.pages.clear()
        seq.released = True
        del self._seqs[s.id]
        if self.evictor is not None:
            self.evictor(0)

    # checks -----------------------------------------------------------
    def check(self) -> None:
        """Verify free + in use == capacity, counts >= 0, the free list is exact, and every
        session's pages are counted."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("free list holds a page twice")
        negative = [p for p, n in enumerate(self.refs) if n < 0]
        if negative:
            raise AssertionError(f"negative reference count on pages {negative[:8]}")
        zero = {p for p, n in enumerate(self.refs) if n == 0}
        if zero != free:
            raise AssertionError(f"free list {sorted(free)[:8]} differs from unreferenced pages "
                                 f"{sorted(zero)[:8]}")
        if self.num_free_pages + self.num_used_pages != self.capacity:
            raise AssertionError("free + in use != capacity")
        held: dict[int, int] = {}
        for seq in self._seqs.values():
            for page in seq.pages:
                held[page] = held.get(page, 0) + 1
        over = [p for p, n in held.items() if n > self.refs[p]]
        if over:
            raise AssertionError(f"sessions hold more references than counted on pages {over[:8]}")
