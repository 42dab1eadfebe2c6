"""A disk tier under the KV pool (docs/design.md §12; LMCache's and SGLang HiCache's lower tiers).

A cached page about to be evicted moves here instead: its K/V are written into a slot of a
file and the pool page is freed. An attach that walks past the pool's pages finds the next
ones here (hashes route, tokens verify, as in the pool), loads them back into free pool
pages and attaches them, so only the tail is prefilled. The tier keeps at most `capacity`
pages and drops its least recently stored one when full (a dropped page's children stay
until they are dropped in turn, unreachable: an attach stops at the gap).

The file fails closed. It is read and written with pread/pwrite, not mapped: a full disk,
a truncated file or a disk error is then an OSError (a page not stored, or a miss, with one
log line a minute), where a memory map would kill the process with SIGBUS. Each page's
CRC-32 (over its K/V and its key) stays in memory beside it and is checked when the page is
loaded back, so a page the disk zeroed or lost is recomputed, never served.

Without K/V storage (the trace replay's bare page manager) it keeps only the pages' keys,
so replay runs the same code with a second capacity.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("prefixlab.cache")
SAY_EVERY_S = 60.0  # a failing disk fails every eviction: one log line a minute, with the counts


def page_record(pool, page: int, out: np.ndarray | None = None) -> np.ndarray:
    """K then V of pool page `page`, every layer, as one contiguous array [2, layers, rows,
    kv heads, head dim]: the bytes a disk-tier slot or a persisted page holds."""
    if out is None:
        out = np.empty((2, pool.k.shape[0], *pool.k.shape[2:]), pool.k.dtype)
    out[0] = pool.k[:, page]
    out[1] = pool.v[:, page]
    return out


def page_checksum(key: int, record: np.ndarray) -> int:
    """CRC-32 of a page record and its key: a page zeroed, cut short or moved on disk fails it."""
    return zlib.crc32(record, zlib.crc32(str(key).encode()))


def _bytes(record: np.ndarray) -> memoryview:
    return memoryview(record.reshape(-1).view(np.uint8))


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


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
    checksum: int = 0   # page_checksum of what was written to the slot


class DiskTier:
    """Up to `capacity` evicted pages, K/V in a file (an unlinked temporary file, mode 0600,
    in `directory`, or the system's temporary folder). The prefix cache holds one and calls
    `demote` and `promote`; `put`, `take` and `clear` move the bytes."""

    def __init__(self, capacity: int, directory: str | None = None):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"disk tier capacity must be an integer >= 1 pages, got {capacity!r}")
        self.capacity = capacity
        self.directory = directory
        self.pages: OrderedDict[int, TierPage] = OrderedDict()  # oldest stored first
        self._free = list(range(capacity - 1, -1, -1))
        self._record: np.ndarray | None = None  # one page's K/V, read or written (None: keys only)
        self._file = None                         # None with a _record: the file could not be made
        self.stored = self.dropped = self.loaded = 0   # pages in, dropped when full, loaded back
        self.write_errors = self.bad_pages = 0         # pages not stored, pages not served
        self.load_seconds = 0.0
        self._said: dict[str, float] = {}

    def bind(self, pool) -> None:
        """Make the file for the pool's page shape (a pool without K/V: keys only)."""
        k = getattr(pool, "k", None)
        if k is None or self._record is not None:
            return
        self._record = np.empty((2, k.shape[0], *k.shape[2:]), k.dtype)
        try:
            self._file = tempfile.TemporaryFile(prefix="prefixlab-disk-tier-", dir=self.directory)
        except OSError as e:
            self._fail("write", f"no file for it ({_reason(e)}): evicted pages are dropped")

    def __len__(self) -> int:
        return len(self.pages)

    def get(self, key: int) -> TierPage | None:
        return self.pages.get(key)

    def _fail(self, kind: str, text: str) -> None:
        now = time.monotonic()
        if now - self._said.get(kind, -SAY_EVERY_S) >= SAY_EVERY_S:
            self._said[kind] = now
            log.warning("disk tier: %s (%d page(s) not stored, %d not served so far)", text,
                        self.write_errors, self.bad_pages)

    def _write(self, slot: int, record: np.ndarray) -> None:
        if self._file is None:
            raise OSError(errno.EBADF, "the tier has no file")
        buf, at = _bytes(record), slot * record.nbytes
        while buf:  # a short write is followed by the write that says why (ENOSPC)
            n = os.pwrite(self._file.fileno(), buf, at)
            buf, at = buf[n:], at + n

    def _read(self, slot: int, record: np.ndarray) -> None:
        buf, at = _bytes(record), slot * record.nbytes
        while buf:
            n = os.preadv(self._file.fileno(), [buf], at)
            if n == 0:
                raise OSError(errno.EIO, "the file ends before the page (it was truncated)")
            buf, at = buf[n:], at + n

    def put(self, entry, pool, preview: str = "") -> list[TierPage]:
        """Copy a cached page (a CachedPage on `pool`) here; return the pages dropped for room.
        A page the file cannot take (a full disk, a disk error) is not stored: check `get`."""
        dropped = []
        while not self._free:
            _, old = self.pages.popitem(last=False)
            self._free.append(old.slot)   # reused: written before, so its blocks are the file's
            dropped.append(old)
        self.dropped += len(dropped)
        slot = self._free.pop()
        checksum = 0
        if self._record is not None:
            record = page_record(pool, entry.page, self._record)
            try:
                self._write(slot, record)
            except OSError as e:
                self._free.append(slot)
                self.write_errors += 1
                self._fail("write", f"a page was not stored, it is dropped as without a tier: {_reason(e)}")
                return dropped
            checksum = page_checksum(entry.key, record)
        self.pages[entry.key] = TierPage(entry.key, slot, entry.tokens, entry.parent, entry.namespace,
                                         entry.depth, entry.chain_id, preview, checksum)
        self.stored += 1
        return dropped

    def take(self, key: int, pool, page: int) -> TierPage | None:
        """Move a page back into pool page `page`; the slot is free again. None when its bytes
        cannot be read or fail their checksum: the page is gone from the tier, counted and
        logged, and `page` was not written (the caller frees it and prefills instead)."""
        tp = self.pages.pop(key)
        self._free.append(tp.slot)
        if self._record is not None:
            record = self._record
            try:
                self._read(tp.slot, record)
                bad = "" if page_checksum(key, record) == tp.checksum else "its checksum differs"
            except OSError as e:
                bad = _reason(e)
            if bad:
                self.bad_pages += 1
                self._fail("read", f"a page was not loaded back, it is recomputed: {bad}")
                return None
            pool.k[:, page] = record[0]
            pool.v[:, page] = record[1]
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
                namespace: str) -> tuple[list[tuple[TierPage, int]], TierPage | None]:
        """Move the pages of `path` ((key, parent key, tokens the page must hold), root to leaf)
        back into free pool pages, stopping at the first this tier lacks or that differs (hashes
        route, tokens verify), or when the pool has no free page: loading never evicts, so it
        cannot take what the attach it serves is about to use. Returns (page, pool page) each,
        and the page that could not be read back (gone from the tier: a miss from there), if any."""
        loaded: list[tuple[TierPage, int]] = []
        lost = None
        t0 = time.perf_counter()
        for key, parent, tokens in path:
            tp = self.pages.get(key)
            if tp is None or tp.parent != parent or tp.namespace != namespace or tp.tokens != tokens:
                break
            if pool.max_pages is not None and not pool.num_free_pages:
                break
            page = pool.alloc()
            if self.take(key, pool, page) is None:  # unreadable or damaged: recomputed, never served
                pool.release(page)
                lost = tp
                break
            loaded.append((tp, page))
        if loaded:
            self.load_seconds += time.perf_counter() - t0
        return loaded, lost
