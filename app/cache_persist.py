"""Persist and restore the prefix cache across restarts (docs/design.md §12; llama.cpp's
--slot-save-path and LMCache's disk backend are the anchors).

One file per directory, `prefix-cache.plkv`, mode 0600: 8 magic bytes, the header's length
(8 bytes, little-endian), a JSON header, a JSON index of pages and chains, then each page's
K and V (engine/disk_tier.py's page record). The header names the format version, the
model file's SHA-256, the page rows, the KV dtype, the architecture, the page count and the
index's length and SHA-256, so a file of another model or another page size is refused
before any page is made; the index gives each page its CRC-32, checked as the pages are
read: a page the disk damaged is skipped (with the pages after it in its chain, which
extend it), counted and named in the load's line, so a prompt that needed it is a miss and
recomputes, while the file's other pages are served.

Reading fails closed: only a regular file is opened (not a link, a FIFO or a device), every
header field is checked for its type and range and against the file's size before anything
is allocated, and the pages are read straight into one array (the load costs the pages it
can keep plus a constant). Writes are atomic (engine/atomic.py): a process stopped
mid-write leaves the old file or the new one (and a killed save's temporary file is removed
by the next save). A file whose structure cannot be trusted (magic, header, index, sizes)
is renamed aside with one line that says what differed, and the cache starts cold; a save
that cannot be written (a full or read-only folder) says so in one line and changes nothing
in the running process.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct
import sys
import time
import types
import typing

import numpy as np

from engine.atomic import atomic_write
from engine.disk_tier import page_checksum, page_record

FORMAT_VERSION = 2   # 2: per-page CRC-32 in the index, pages as records, no whole-body hash
MAGIC = b"PLXKVC\x00\x01"
FILE_NAME = "prefix-cache.plkv"
MAX_HEADER_BYTES = 1 << 16
STALE_TEMP_S = 60.0  # a save writes its temporary file steadily: one untouched this long was killed
_sha_memo: dict[tuple, str] = {}


class CacheFileError(ValueError):
    """A cache file that cannot be used; the message says what differed."""


class Restored(typing.NamedTuple):
    """What a load made of a cache file: the pages re-created, and the pages skipped because
    they failed their CRC-32 (the pages after them in their chains are not counted here)."""
    pages: int
    damaged: int


def model_sha256(path: str) -> str:
    """SHA-256 of the model file (remembered per path, size and mtime for this process)."""
    st = os.stat(path)
    memo_key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if memo_key not in _sha_memo:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        _sha_memo[memo_key] = h.hexdigest()
    return _sha_memo[memo_key]


def expected_header(model, pool) -> dict:
    """What a cache file for this model and pool must say about itself."""
    c = model.config
    return {"format": FORMAT_VERSION, "model_sha256": model_sha256(model.path), "page_rows": pool.page_rows,
            "kv_dtype": pool.kv_dtype, "arch": model.arch,
            "kv_shape": [c.n_layers, pool.page_rows, c.n_kv_heads, c.head_dim]}


def write_cache(fh: typing.BinaryIO, cache, pool, model) -> int:
    """Write the cache's pages (parents first), chains and K/V to `fh`, a page at a time; the
    pages written."""
    entries = sorted(cache.entries(), key=lambda e: e.depth)
    record = None
    pages = []
    for e in entries:
        record = page_record(pool, e.page, record)
        pages.append([e.key, e.parent, list(e.tokens), e.namespace, e.depth, e.chain_id,
                      page_checksum(e.key, record)])
    meta = json.dumps({"pages": pages, "chains": [vars(c) for c in cache.chain_list()]},
                      allow_nan=False).encode("utf-8")
    header = {**expected_header(model, pool), "n_pages": len(entries), "index_bytes": len(meta),
              "index_sha256": hashlib.sha256(meta).hexdigest(), "saved_at": time.time()}
    head = json.dumps(header).encode("utf-8")
    fh.write(MAGIC + struct.pack("<Q", len(head)) + head)
    fh.write(meta)
    for e in entries:
        record = page_record(pool, e.page, record)
        fh.write(memoryview(record.reshape(-1).view(np.uint8)))
    return len(entries)


def _short(value) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:30] + "..." + text[-6:]
    return text


def _same(a, b) -> bool:
    """Equal as JSON, types included (true is not 1, 4.0 is not 4)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _int_field(header: dict, field: str, hi: int) -> int:
    value = header.get(field)
    if type(value) is not int or not 0 <= value <= hi:
        raise CacheFileError(f"its header's {field} is {_short(value)}, not an integer from 0 to {hi}")
    return value


def _read_exact(fh, buf) -> None:
    view = memoryview(buf).cast("B")
    while view:
        n = fh.readinto(view)
        if not n:
            raise CacheFileError("it is truncated (it ended while it was read)")
        view = view[n:]


def _json(data: bytearray, what: str):
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:   # bad UTF-8, bad JSON, nested too deep
        raise CacheFileError(f"its {what} is corrupt ({type(e).__name__}: {str(e)[:80]})") from None


def read_header(fh, size: int, want: dict, itemsize: int) -> tuple[dict, int]:
    """The header of an open file of `size` bytes, each field checked (CacheFileError naming
    the field), and its length."""
    lead = bytearray(16)
    _read_exact(fh, lead)
    if lead[:8] != MAGIC:
        raise CacheFileError("it is not a PrefixLab cache file (bad magic bytes)")
    (n,) = struct.unpack("<Q", lead[8:])
    if n > min(MAX_HEADER_BYTES, size - 16):
        raise CacheFileError(f"it is truncated or corrupt (a header of {n} bytes in a file of {size})")
    head = bytearray(n)
    _read_exact(fh, head)
    header = _json(head, "header")
    if not isinstance(header, dict):
        raise CacheFileError("its header is corrupt (not an object)")
    for field, value in want.items():   # format first: another version's fields mean other things
        if not _same(header.get(field), value):
            raise CacheFileError(f"{field} differs: the file has {_short(header.get(field))}, "
                                 f"this run {_short(value)}")
    page_bytes = 2 * math.prod(want["kv_shape"]) * itemsize
    n_pages = _int_field(header, "n_pages", (size - 16 - n) // page_bytes)
    index_bytes = _int_field(header, "index_bytes", size - 16 - n)
    digest = header.get("index_sha256")
    if not (isinstance(digest, str) and len(digest) == 64):
        raise CacheFileError(f"its header's index_sha256 is {_short(digest)}, not a SHA-256")
    expected = 16 + n + index_bytes + n_pages * page_bytes
    if size < expected:
        raise CacheFileError(f"it is truncated ({size} bytes; its n_pages and index_bytes say {expected})")
    if size > expected:
        raise CacheFileError(f"its size differs from its header's: {size} bytes, its n_pages and "
                             f"index_bytes say {expected}")
    return header, n


def _check(hint, value) -> bool:
    """`value` is of type `hint` (int, float, str, bool or one of them | None), as JSON gives it."""
    if hint is float:
        return type(value) in (int, float) and math.isfinite(value)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_check(h, value) for h in typing.get_args(hint))
    return type(value) is hint


def _chains(raw, chain_type) -> list:
    hints = typing.get_type_hints(chain_type)
    if not isinstance(raw, list):
        raise CacheFileError("its page index is corrupt (chains is not a list)")
    chains = []
    for i, c in enumerate(raw):
        if not isinstance(c, dict):
            raise CacheFileError(f"its page index is corrupt (chain {i} is not an object)")
        for field, value in c.items():
            if field not in hints or not _check(hints[field], value):
                raise CacheFileError(f"its page index is corrupt (chain {i}'s {field} is {_short(value)})")
        try:
            chains.append(chain_type(**c))
        except TypeError as e:
            raise CacheFileError(f"its page index is corrupt (chain {i}: {e})") from None
    return chains


def _page(i: int, p, rows: int, chain_ids) -> tuple:
    if not (isinstance(p, list) and len(p) == 7):
        raise CacheFileError(f"its page index is corrupt (page {i} is not a list of 7 fields)")
    key, parent, toks, namespace, depth, chain_id, checksum = p
    checks = {"key": type(key) is int and 0 <= key < 1 << 64,
              "parent": parent is None or (type(parent) is int and 0 <= parent < 1 << 64),
              "tokens": isinstance(toks, list) and len(toks) == rows
              and all(type(t) is int and 0 <= t < 1 << 31 for t in toks),
              "namespace": type(namespace) is str,
              "depth": type(depth) is int and depth >= 0,
              "chain id": type(chain_id) is int and chain_id in chain_ids,
              "checksum": type(checksum) is int and 0 <= checksum < 1 << 32}
    bad = [name for name, ok in checks.items() if not ok]
    if bad:
        raise CacheFileError(f"its page index is corrupt (page {i}'s {bad[0]} is "
                             f"{_short(p[list(checks).index(bad[0])])})")
    return key, parent, toks, namespace, depth, chain_id, checksum


def restore_cache(cache, pool, model, fh, size: int) -> Restored:
    """Re-create the cached pages of an open cache file of `size` bytes in `cache`, or
    CacheFileError when the file's structure cannot be trusted. A page failing its CRC-32 is
    never served: it is skipped and counted, and so are (uncounted) the pages below it, whose
    parent it is; the rest load."""
    from engine.prefix_records import ChainRecord
    header, _ = read_header(fh, size, expected_header(model, pool), pool.k.itemsize)
    meta = bytearray(header["index_bytes"])
    _read_exact(fh, meta)
    if hashlib.sha256(meta).hexdigest() != header["index_sha256"]:
        raise CacheFileError("its page index is corrupt (its SHA-256 differs from the header's index_sha256)")
    index = _json(meta, "page index")
    del meta
    if not (isinstance(index, dict) and isinstance(index.get("pages"), list)
            and len(index["pages"]) == header["n_pages"]):
        raise CacheFileError(f"its page index is corrupt (not {header['n_pages']} pages)")
    chains = _chains(index.get("chains"), ChainRecord)
    ids = {c.id for c in chains}
    pages = [_page(i, p, pool.page_rows, ids) for i, p in enumerate(index["pages"])]
    # parents come first: pages past what the cache and the pool can hold are never read
    room = [n for n in (cache.max_pages, pool.max_pages) if n]
    n_read = min([len(pages), *room])
    records = np.empty((n_read, 2, *header["kv_shape"]), dtype=pool.k.dtype)
    _read_exact(fh, records)
    good = [i for i in range(n_read) if page_checksum(pages[i][0], records[i]) == pages[i][6]]

    def fill(j: int, page: int) -> None:
        pool.k[:, page] = records[good[j], 0]
        pool.v[:, page] = records[good[j], 1]
    try:   # adopt skips a page whose parent is not cached: a damaged page's descendants too
        made = cache.adopt(pool, [pages[i][:6] for i in good], chains, fill)
    except ValueError as e:
        raise CacheFileError(f"its page index is corrupt ({e})") from None
    return Restored(made, n_read - len(good))


def open_regular(path: str):
    """`path` opened for reading if it is a regular file (never a link, FIFO or device, which
    could block or never end), with its size; None when there is none; CacheFileError else."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as e:
        if os.path.islink(path):
            raise CacheFileError("it is a symbolic link, not a file PrefixLab wrote") from None
        raise CacheFileError(f"it cannot be opened ({e.strerror or e})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CacheFileError("it is not a regular file")
    return os.fdopen(fd, "rb", buffering=0), st.st_size


class PersistedCache:
    """A scheduler's cache kept in DIR across runs: `load()` at start, `save()` on exit."""

    def __init__(self, directory: str, scheduler, out=None):
        self.dir = directory
        self.path = os.path.join(directory, FILE_NAME)
        self.scheduler = scheduler
        self.out = out or sys.stderr
        self.damaged = 0   # the last load's pages that failed their CRC-32 (skipped, never served)

    def _say(self, text: str) -> None:
        print(f"prefixlab: cache {self.path}: {text}", file=self.out, flush=True)

    def load(self) -> int:
        """Load a matching file before the first request, one line; the pages loaded. A file
        that cannot be trusted is renamed aside; damaged pages are skipped and counted in
        `damaged` (the next save rewrites the file without them)."""
        sch = self.scheduler
        self.damaged = 0
        try:
            opened = open_regular(self.path)
            if opened is None:
                return 0
            with opened[0] as fh:
                n, self.damaged = restore_cache(sch.cache, sch.pool, sch.model, fh, opened[1])
        except (CacheFileError, OSError, MemoryError) as e:
            sch.cache.release(sch.pool)  # nothing half-restored: a cold cache
            aside = f"{self.path}.rejected-{time.strftime('%Y%m%d-%H%M%S')}"
            try:
                os.replace(self.path, aside)
            except OSError:
                aside = "(could not move it aside)"
            reason = e if isinstance(e, CacheFileError) else f"{type(e).__name__}: {e}"
            self._say(f"not loaded: {reason}; moved to {aside}; starting with a cold cache")
            return 0
        if self.damaged:
            self._say(f"loaded {n} page(s); {self.damaged} damaged page(s) (failing their CRC-32) "
                      "skipped with the pages after them: prompts that need them recompute")
        else:
            self._say(f"loaded {n} page(s)")
        return n

    def save(self) -> int:
        """Write the cache atomically, mode 0600; the pages written (0, and one line, when the
        folder is read-only or full: the old file stays, the cache in memory is untouched)."""
        sch = self.scheduler
        try:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            self._sweep()
            atomic_write(self.path, lambda fh: write_cache(fh, sch.cache, sch.pool, sch.model), mode=0o600)
        except OSError as e:
            reason = getattr(e, "reason", None) or e.strerror or str(e)
            self._say(f"not saved: {reason} (the previous file, if any, is as it was)")
            return 0
        n = len(sch.cache.pages)
        self._say(f"saved {n} page(s)")
        return n

    def _sweep(self) -> None:
        """Remove the temporary files of saves killed before their rename (SIGKILL, a power cut:
        engine/atomic.py removes its own on any exception)."""
        prefix = f".{FILE_NAME}."
        for name in os.listdir(self.dir):
            if name.startswith(prefix) and name.endswith(".tmp"):
                path = os.path.join(self.dir, name)
                try:
                    if time.time() - os.lstat(path).st_mtime > STALE_TEMP_S:
                        os.unlink(path)
                except OSError:
                    pass  # gone already, or not ours to remove: the save goes on


def persist_from_args(args, scheduler) -> PersistedCache | None:
    """`--persist-cache DIR`: the scheduler's cache kept there, loaded now (None without it)."""
    directory = getattr(args, "persist_cache", None)
    if not directory:
        return None
    persisted = PersistedCache(directory, scheduler)
    persisted.load()
    return persisted
