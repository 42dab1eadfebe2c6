"""Persist and restore the prefix cache across restarts (docs/design.md §12; llama.cpp's
--slot-save-path and LMCache's disk backend are the anchors).

One file per directory, `prefix-cache.plkv`: 8 magic bytes, the header's length (8 bytes,
little-endian), a JSON header, then the body: a JSON index of pages and chains followed by
the K and V of every page. The header names the format version, the model file's SHA-256,
the page rows, the KV dtype, the architecture and the body's length and SHA-256, so a file
of another model, another page size or with one flipped byte is refused before any page is
made. Writes are atomic (a temporary file, fsync, rename): a process killed mid-write
leaves the old file or the new one. A refused file is renamed aside with one line that
says what differed, and the cache starts cold; tokens are verified on attach as always.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import time

import numpy as np

FORMAT_VERSION = 1
MAGIC = b"PLXKVC\x00\x01"
FILE_NAME = "prefix-cache.plkv"
_sha_memo: dict[tuple, str] = {}


class CacheFileError(ValueError):
    """A cache file that cannot be used; the message says what differed."""


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


def encode_cache(cache, pool, model) -> bytes:
    """The cache's pages (parents first), chains and K/V as one file's bytes."""
    entries = sorted(cache.entries(), key=lambda e: e.depth)
    index = {"pages": [[e.key, e.parent, list(e.tokens), e.namespace, e.depth, e.chain_id] for e in entries],
             "chains": [vars(c) for c in cache.chain_list()]}
    ids = [e.page for e in entries]
    meta = json.dumps(index).encode("utf-8")
    body = b"".join([meta, np.ascontiguousarray(pool.k[:, ids]).tobytes(),
                     np.ascontiguousarray(pool.v[:, ids]).tobytes()])
    header = {**expected_header(model, pool), "n_pages": len(ids), "index_bytes": len(meta),
              "body_bytes": len(body), "body_sha256": hashlib.sha256(body).hexdigest(),
              "saved_at": time.time()}
    head = json.dumps(header).encode("utf-8")
    return MAGIC + struct.pack("<Q", len(head)) + head + body


def _short(value) -> str:
    text = repr(value)
    return text[:14] + "...'" if isinstance(value, str) and len(value) > 16 else text


def decode_cache(data: bytes, want: dict) -> tuple[dict, dict, bytes]:
    """(header, index, K/V bytes) of a file's bytes, or CacheFileError saying what differed."""
    if len(data) < 16 or data[:8] != MAGIC:
        raise CacheFileError("it is not a PrefixLab cache file (bad magic bytes)")
    (n,) = struct.unpack("<Q", data[8:16])
    if n > len(data) - 16:
        raise CacheFileError(f"it is truncated (header of {n} bytes, file of {len(data)})")
    try:
        header = json.loads(data[16:16 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CacheFileError(f"its header is corrupt ({e})") from None
    if not isinstance(header, dict):
        raise CacheFileError("its header is corrupt (not an object)")
    for field, value in want.items():
        if header.get(field) != value:
            raise CacheFileError(f"{field} differs: the file has {_short(header.get(field))}, "
                                 f"this run {_short(value)}")
    body = data[16 + n:]
    if len(body) != header.get("body_bytes"):
        raise CacheFileError(f"it is truncated (body of {len(body)} bytes, header says "
                             f"{header.get('body_bytes')})")
    if hashlib.sha256(body).hexdigest() != header.get("body_sha256"):
        raise CacheFileError("its body is corrupt (SHA-256 differs from the header's)")
    try:
        meta_len = int(header["index_bytes"])
        index = json.loads(body[:meta_len])
    except (KeyError, ValueError, UnicodeDecodeError) as e:
        raise CacheFileError(f"its page index is corrupt ({e})") from None
    return header, index, body[meta_len:]


def restore_cache(cache, pool, model, data: bytes) -> int:
    """Re-create the cached pages of a file's bytes in `cache`; the pages made (CacheFileError)."""
    from engine.prefix_records import ChainRecord
    header, index, kv = decode_cache(data, expected_header(model, pool))
    n_layers, *page_shape = header["kv_shape"]
    shape = [n_layers, int(header.get("n_pages", -1)), *page_shape]   # as written: pool.k[:, pages]
    per = int(np.prod(shape)) * pool.k.itemsize
    if shape[1] < 0 or len(kv) != 2 * per:
        raise CacheFileError(f"its K/V holds {len(kv)} bytes, {2 * per} expected")
    k = np.frombuffer(kv[:per], dtype=pool.k.dtype).reshape(shape)
    v = np.frombuffer(kv[per:], dtype=pool.k.dtype).reshape(shape)

    def fill(i: int, page: int) -> None:
        pool.k[:, page] = k[:, i]
        pool.v[:, page] = v[:, i]
    try:
        chains = [ChainRecord(**c) for c in index["chains"]]
        pages = [(p[0], p[1], p[2], p[3], p[4], p[5]) for p in index["pages"]]
        return cache.adopt(pool, pages, chains, fill)
    except (TypeError, KeyError, IndexError, ValueError) as e:
        raise CacheFileError(f"its page index is corrupt ({e})") from None


class PersistedCache:
    """A scheduler's cache kept in DIR across runs: `load()` at start, `save()` on exit."""

    def __init__(self, directory: str, scheduler, out=None):
        self.dir = directory
        self.path = os.path.join(directory, FILE_NAME)
        self.scheduler = scheduler
        self.out = out or sys.stderr

    def _say(self, text: str) -> None:
        print(f"prefixlab: cache {self.path}: {text}", file=self.out, flush=True)

    def load(self) -> int:
        """Load a matching file before the first request; a bad one is renamed aside (one line)."""
        if not os.path.exists(self.path):
            return 0
        sch = self.scheduler
        try:
            with open(self.path, "rb") as fh:
                data = fh.read()
            n = restore_cache(sch.cache, sch.pool, sch.model, data)
        except (CacheFileError, OSError) as e:
            sch.cache.release(sch.pool)  # nothing half-restored: a cold cache
            aside = f"{self.path}.rejected-{time.strftime('%Y%m%d-%H%M%S')}"
            try:
                os.replace(self.path, aside)
            except OSError:
                aside = "(could not move it aside)"
            self._say(f"not loaded: {e}; moved to {aside}; starting with a cold cache")
            return 0
        self._say(f"loaded {n} page(s)")
        return n

    def save(self) -> int:
        """Write the cache atomically; the pages written."""
        from .report.files import atomic_write  # on exit only: `prefixlab run` starts without it
        sch = self.scheduler
        os.makedirs(self.dir, exist_ok=True)
        data = encode_cache(sch.cache, sch.pool, sch.model)
        atomic_write(self.path, lambda fh: fh.write(data))
        n = len(sch.cache.pages)
        self._say(f"saved {n} page(s)")
        return n


def persist_from_args(args, scheduler) -> PersistedCache | None:
    """`--persist-cache DIR`: the scheduler's cache kept there, loaded now (None without it)."""
    directory = getattr(args, "persist_cache", None)
    if not directory:
        return None
    persisted = PersistedCache(directory, scheduler)
    persisted.load()
    return persisted
