"""A paged KV pool: reference-counted pages of K and V for every layer."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from .config import ModelConfig
from .errors import PoolExhausted

INITIAL_PAGES = 64
_pool_ids = itertools.count(1)
_session_ids = itertools.count(1)


class KVPool:
    """Pages of `page_rows` positions; K/V arrays are [layers, pages, rows, kv_heads, head_dim].

    A page is free when its reference count is 0. Sessions and the prefix cache
    each hold one reference on a page they use; sharing is by reference only.
    With `max_pages=None` the pool grows by doubling; otherwise it is bounded and,
    when empty, asks its reclaimers (prefix caches) to give pages back.
    """

    def __init__(self, cfg: ModelConfig, page_rows: int = 16, max_pages: int | None = None):
        if not isinstance(page_rows, int) or page_rows < 1:
            raise ValueError(f"page_rows must be a positive integer, got {page_rows!r}")
        if max_pages is not None and (not isinstance(max_pages, int) or max_pages < 1):
            raise ValueError(f"max_pages must be a positive integer or None, got {max_pages!r}")
        self.id = next(_pool_ids)
        self.cfg = cfg
        self.page_rows = page_rows
        self.max_pages = max_pages
        start = max_pages if max_pages is not None else INITIAL_PAGES
        self.k = self._zeros(start)
        self.v = self._zeros(start)
        self.refcount = np.zeros(start, dtype=np.int64)
        self._free: list[int] = list(range(start - 1, -1, -1))  # pop() gives the lowest id
        self.reclaimers: list = []

    def _zeros(self, n: int) -> np.ndarray:
        c = self.cfg
        return np.zeros((c.n_layers, n, self.page_rows, c.n_kv_heads, c.head_dim), dtype=np.float32)

    @property
    def capacity(self) -> int:
        return len(self.refcount)

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.capacity - len(self._free)

    def _grow(self) -> None:
        old = self.capacity
        new = old * 2
        self.k = np.concatenate([self.k, self._zeros(old)], axis=1)
        self.v = np.concatenate([self.v, self._zeros(old)], axis=1)
        self.refcount = np.concatenate([self.refcount, np.zeros(old, dtype=np.int64)])
        self._free = list(range(new - 1, old - 1, -1)) + self._free

    def alloc(self) -> int:
        """A free page with reference count 1; evicts cached pages or raises PoolExhausted."""
        if not self._free:
            if self.max_pages is None:
                self._grow()
            else:
                for reclaimer in self.reclaimers:
                    if reclaimer.evict_for_pool(self, 1):
                        break
        if not self._free:
            raise PoolExhausted(
                f"KV pool is full: all {self.capacity} pages are in use by sessions "
                f"and the prefix cache has nothing it can evict")
        page = self._free.pop()
        self.refcount[page] = 1
        return page

    def retain(self, page: int) -> None:
        """Take one more reference on a page in use."""
        if self.refcount[page] <= 0:
            raise ValueError(f"page {page} is free; cannot take a reference on it")
        self.refcount[page] += 1

    def release(self, page: int) -> None:
        """Drop one reference; the page returns to the free list at 0."""
        if self.refcount[page] <= 0:
            raise ValueError(f"page {page} is already free; released twice")
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            self._free.append(page)

    def add_reclaimer(self, reclaimer) -> None:
        if reclaimer not in self.reclaimers:
            self.reclaimers.append(reclaimer)

    def check(self) -> None:
        """Verify free + in use == capacity, counts >= 0, and the free list is exact."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("free list holds a page twice")
        if (self.refcount < 0).any():
            bad = np.flatnonzero(self.refcount < 0)
            raise AssertionError(f"negative reference count on pages {bad}")
        zero = set(np.flatnonzero(self.refcount == 0).tolist())
        if zero != free:
            raise AssertionError(f"free list {sorted(free)[:8]} differs from unreferenced pages "
                                 f"{sorted(zero)[:8]}")
        if self.num_free_pages + self.num_used_pages != self.capacity:
            raise AssertionError("free + in use != capacity")


@dataclass
class Session:
    """One sequence's KV state: a page table into a pool, and the tokens evaluated."""

    pool: KVPool
    page_table: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    n_past: int = 0
    released: bool = False
    id: int = field(default_factory=lambda: next(_session_ids))

    def ensure_pages(self, n_positions: int) -> None:
        """Allocate pages until the table covers `n_positions` positions."""
        need = -(-n_positions // self.pool.page_rows)
        while len(self.page_table) < need:
            self.page_table.append(self.pool.alloc())

    def release(self) -> None:
        """Hand every page back to the pool; the session cannot be used after."""
        if self.released:
            raise ValueError(f"session {self.id} was already released")
        for page in self.page_table:
            self.pool.release(page)
        self.page_table.clear()
        self.released = True
