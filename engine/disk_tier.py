"""A disk tier under the KV pool (docs/design.md §12; LMCache's and SGLang HiCache's lower tiers).

A cached page about to be evicted moves here instead: its K/V are copied into a slot of a
memory-mapped file and the pool page is freed. An attach that walks past the pool's pages
finds the next ones here (hashes route, tokens verify, as in the pool), loads them back
into free pool pages and attaches them, so only the tail is prefilled. The tier keeps at
most `capacity` pages and drops its least recently stored one when full (a dropped page's
children stay until they are dropped in turn, unreachable: an attach stops at the gap).

Without K/V storage (the trace replay's bare page manager) it keeps only the pages' keys,
so replay runs the same code with a second capacity.
"""

from __future__ import annotations

import tempfile
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class TierPage:
    """A page in the disk tier: its slot in the file and its place in the tree of prefixes."""

    key: int
    slot: int
    tokens: tuple[int, ...]
    parent: int | None
    namespace: str
    depth: int
    chain_id: int
    preview: str = ""


class DiskTier:
    """Up to `capacity` evicted pages, K/V in a memory-mapped file (an unlinked temporary file
    in `directory`, or the system's temporary folder). The prefix cache holds one and calls
    `demote` and `promote`; `put`, `take` and `clear` move the bytes."""

    def __init__(self, capacity: int, directory: str | None = None):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"disk tier capacity must be an integer >= 1 pages, got {capacity!r}")
        self.capacity = capacity
        self.directory = directory
        self.pages: OrderedDict[int, TierPage] = OrderedDict()  # oldest stored first
        self._free = list(range(capacity - 1, -1, -1))
        self.k: np.memmap | None = None
        self.v: np.memmap | None = None
        self._file = None
        self.stored = self.dropped = self.loaded = 0   # pages in, dropped when full, loaded back
        self.load_seconds = 0.0

    def bind(self, pool) -> None:
        """Make the file for the pool's page shape (a pool without K/V: keys only)."""
        k = getattr(pool, "k", None)
        if k is None or self.k is not None:
            return
        shape = (self.capacity, k.shape[0], *k.shape[2:])   # [slot, layers, rows, kv heads, dim]
        self._file = tempfile.TemporaryFile(prefix="prefixlab-disk-tier-", dir=self.directory)
        self._file.truncate(2 * int(np.prod(shape)) * k.itemsize)  # sparse until written
        self.k = np.memmap(self._file, dtype=k.dtype, mode="r+", shape=shape)
        self.v = np.memmap(self._file, dtype=k.dtype, mode="r+", shape=shape,
                           offset=int(np.prod(shape)) * k.itemsize)

    def __len__(self) -> int:
        return len(self.pages)

    def get(self, key: int) -> TierPage | None:
        return self.pages.get(key)

    def put(self, entry, pool, preview: str = "") -> list[TierPage]:
        """Copy a cached page (a CachedPage on `pool`) here; return the pages dropped for room."""
        dropped = []
        while not self._free:
            _, old = self.pages.popitem(last=False)
            self._free.append(old.slot)
            dropped.append(old)
        self.dropped += len(dropped)
        slot = self._free.pop()
        if self.k is not None:
            self.k[slot] = pool.k[:, entry.page]
            self.v[slot] = pool.v[:, entry.page]
        self.pages[entry.key] = TierPage(entry.key, slot, entry.tokens, entry.parent, entry.namespace,
                                         entry.depth, entry.chain_id, preview)
        self.stored += 1
        return dropped

    def take(self, key: int, pool, page: int) -> TierPage:
        """Move a page back into pool page `page`; the slot is free again."""
        tp = self.pages.pop(key)
        if self.k is not None:
            pool.k[:, page] = self.k[tp.slot]
            pool.v[:, page] = self.v[tp.slot]
        self._free.append(tp.slot)
        self.loaded += 1
        return tp

    def clear(self) -> list[TierPage]:
        """Forget every page; return them."""
        gone = list(self.pages.values())
        self.pages.clear()
        self._free = list(range(self.capacity - 1, -1, -1))
        return gone

    # the prefix cache's calls -----------------------------------------
    def demote(self, entry, pool, preview: str = "") -> list[TierPage]:
        """Take a cached page about to be evicted from the pool (it keeps its key, parent, tokens
        and chain); return the pages dropped, oldest stored first, to make room for it."""
        return self.put(entry, pool, preview)

    def promote(self, pool, path: Iterable[tuple[int, int | None, tuple]],
                namespace: str) -> list[tuple[TierPage, int]]:
        """Move the pages of `path` ((key, parent key, tokens the page must hold), root to leaf)
        back into free pool pages, stopping at the first this tier lacks or that differs (hashes
        route, tokens verify), or when the pool has no free page: loading never evicts, so it
        cannot take what the attach it serves is about to use. Returns (page, pool page) each."""
        loaded: list[tuple[TierPage, int]] = []
        t0 = time.perf_counter()
        for key, parent, tokens in path:
            tp = self.pages.get(key)
            if tp is None or tp.parent != parent or tp.namespace != namespace or tp.tokens != tokens:
                break
            if pool.max_pages is not None and not pool.num_free_pages:
                break
            page = pool.alloc()
            loaded.append((self.take(key, pool, page), page))
        if loaded:
            self.load_seconds += time.perf_counter() - t0
        return loaded
