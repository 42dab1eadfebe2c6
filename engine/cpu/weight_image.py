"""A prepared float32 weight image: written once per GGUF, memory-mapped after.

Layout of an image folder: `index.json` (what the arrays are, where they lie,
and checksums) and `weights.bin` (the arrays back to back, 64-byte aligned, and the
matrices at 2 MiB boundaries so the kernel can map them with huge pages, see HUGE_PAGE).
An image is used only when the GGUF's size, mtime and header checksum, the
index's own checksum and the data checksum all agree; anything else rebuilds it.
The data checksum is computed once: `verified.json` then records weights.bin's
size, inode, mtime and ctime, and a load whose stat still matches skips the
half-second re-read (any write to the file moves its ctime, which no user can set back).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import shutil
import zlib

import numpy as np

from ..atomic import atomic_dir, atomic_write
from . import shared_matmul

IMAGE_VERSION = 9  # 2: index checksum; 3: head [d, vocab]; 5: architectures, one head copy; 6: blocks;
#                   7: matrices on huge-page boundaries; 8: transposed blocks too; 9: the model's name
#                   from its file when general.name is a build string (engine/gguf_loader.py)
ALIGN = 64
# Decode reads every weight once a step, so TLB misses on 4 KiB pages cost it dearly: measured on
# a 2-core EPYC, the matrices of one step read in 25 ms through 4 KiB pages and 18.5 ms through
# 2 MiB ones (8 rows: 36 -> 28 ms). The kernel maps a file with huge pages where its page cache
# holds 2 MiB folios, which it makes for 2 MiB-aligned writes and, under MADV_HUGEPAGE, for reads.
HUGE_PAGE = 2 << 20
CRC_BLOCK = 1 << 24


def cache_root() -> str:
    """Where weight images live: $PREFIXLAB_CACHE_DIR, else the user cache dir."""
    root = os.environ.get("PREFIXLAB_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "prefixlab")
    return os.path.join(root, "weights")


def file_crc(path: str, length: int | None = None) -> int:
    """CRC-32 of the first `length` bytes of a file (all of it when None)."""
    crc = 0
    remaining = os.path.getsize(path) if length is None else length
    with open(path, "rb") as fh:
        while remaining > 0:
            block = fh.read(min(CRC_BLOCK, remaining))
            if not block:
                break
            crc = zlib.crc32(block, crc)
            remaining -= len(block)
    return crc


def image_key(gguf_path: str) -> str:
    """Folder name of a GGUF's image: format version, size, mtime and a checksum of its first MiB.

    The version is in the name so two PrefixLab versions sharing a cache do not rebuild
    each other's image on every start.
    """
    st = os.stat(gguf_path)
    return f"v{IMAGE_VERSION}-{st.st_size}-{st.st_mtime_ns}-{file_crc(gguf_path, 1 << 20):08x}"


def image_dir(gguf_path: str) -> str:
    return os.path.join(cache_root(), image_key(gguf_path))


def _index_crc(meta: dict) -> int:
    # the data CRC does not cover index.json: an edited offset, shape or config must not pass
    body = {k: v for k, v in meta.items() if k != "index_crc"}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode("utf-8"))


def write_image(gguf_path: str, header_bytes: int, arrays, info: dict) -> str:
    """Write (name, array) pairs and info atomically into this GGUF's image folder; return it.

    `arrays` may be a generator: each array is written and dropped before the next is made.
    """
    final = image_dir(gguf_path)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    with atomic_dir(final) as tmp:
        index, offset, crc = {}, 0, 0
        with open(os.path.join(tmp, "weights.bin"), "wb") as fh:
            for name, arr in arrays:
                arr = np.ascontiguousarray(arr, dtype=np.float32)
                pad = b"\0" * ((-offset) % (HUGE_PAGE if arr.nbytes >= HUGE_PAGE else ALIGN))
                data = memoryview(arr).cast("B")
                for chunk in (pad, data):
                    fh.write(chunk)
                    crc = zlib.crc32(chunk, crc)
                offset += len(pad)
                index[name] = {"offset": offset, "shape": list(arr.shape)}
                offset += arr.nbytes
                del arr, data
        meta = {
            "version": IMAGE_VERSION,
            "gguf_header_bytes": header_bytes,
            "gguf_header_crc": file_crc(gguf_path, header_bytes),
            "data_bytes": offset,
            "data_crc": crc,
            "arrays": index,
            "info": info,
        }
        meta["index_crc"] = _index_crc(meta)
        with open(os.path.join(tmp, "index.json"), "w", encoding="utf-8") as fh:
            json.dump(meta, fh)
    _write_stamp(final, crc)
    _drop_older_versions(final)
    return final


def _drop_older_versions(final: str) -> None:
    """Remove the images an older PrefixLab wrote of the very same GGUF (same size, mtime and
    checksum): each is as big as the weights, and this version never reads them. Newer versions'
    images stay, so two versions sharing a cache each keep their own."""
    _, rest = os.path.basename(final).split("-", 1)
    root = os.path.dirname(final)
    for name in os.listdir(root):
        version, _, key = name.partition("-")
        older = version.startswith("v") and version[1:].isdigit() and int(version[1:]) < IMAGE_VERSION
        if key == rest and older:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


STAMP = "verified.json"


def _file_stamp(path: str, crc: int) -> dict:
    st = os.stat(path)
    return {"size": st.st_size, "ino": st.st_ino, "dev": st.st_dev, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "data_crc": crc}


def _write_stamp(folder: str, crc: int) -> None:
    """Record that weights.bin, as it is now, has checksum `crc` (best effort)."""
    try:
        stamp = _file_stamp(os.path.join(folder, "weights.bin"), crc)
        with open(os.path.join(folder, STAMP), "w", encoding="utf-8") as fh:
            json.dump(stamp, fh)
    except OSError:
        pass  # without a stamp the next load only re-reads the data once more


def _stamp_matches(folder: str, crc: int) -> bool:
    """True when weights.bin is untouched since its checksum `crc` was last verified."""
    try:
        with open(os.path.join(folder, STAMP), encoding="utf-8") as fh:
            stamp = json.load(fh)
        return stamp == _file_stamp(os.path.join(folder, "weights.bin"), crc)
    except (OSError, ValueError):
        return False


def read_image(gguf_path: str) -> tuple[dict[str, np.ndarray], dict] | None:
    """Memory-map a valid image of this GGUF, or None when absent, stale or corrupt."""
    folder = image_dir(gguf_path)
    index_path, data_path = os.path.join(folder, "index.json"), os.path.join(folder, "weights.bin")
    try:
        with open(index_path, encoding="utf-8") as fh:
            meta = json.load(fh)
        if meta.get("version") != IMAGE_VERSION or meta.get("index_crc") != _index_crc(meta):
            return None
        if os.path.getsize(data_path) != meta["data_bytes"]:
            return None
        if file_crc(gguf_path, meta["gguf_header_bytes"]) != meta["gguf_header_crc"]:
            return None
        if not _stamp_matches(folder, meta["data_crc"]):
            if file_crc(data_path) != meta["data_crc"]:
                return None
            _write_stamp(folder, meta["data_crc"])
        # A plain read-only ndarray over the map (np.memmap's Python-level hooks cost ~0.6 ms a token)
        blob = np.frombuffer(_map_huge(data_path), dtype=np.uint8)
        shared_matmul.share_file(data_path, blob)  # helper processes read their share of decode's blocks here
        arrays = {}
        for name, spec in meta["arrays"].items():
            shape = tuple(int(x) for x in spec["shape"])
            n = int(np.prod(shape)) * 4
            start = int(spec["offset"])
            if start < 0 or start % ALIGN or start + n > blob.size:
                return None
            arrays[name] = blob[start:start + n].view(np.float32).reshape(shape)
        return arrays, meta["info"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _map_huge(path: str) -> mmap.mmap:
    """The file mapped read-only, advised to come in as 2 MiB pages (HUGE_PAGE says why)."""
    with open(path, "rb") as fh:
        raw = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            raw.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # a kernel without transparent huge pages: 4 KiB pages, as before
    return raw


_MADV_DONTNEED = 4  # Linux: drop these pages from this process; a mapped file's come back on the next read
_MADV_POPULATE_READ = 22  # Linux 5.14+: map a range now, as reads would, without reading it into the caches
HUGE_ENOUGH = 0.9   # the share of the read copy in 2 MiB pages below which its page cache is read again
HUGE_FILE = "huge.json"  # this boot's failed attempt to read the image in 2 MiB pages: not tried again


def settle_huge(folder: str, arrays: list[np.ndarray]) -> dict:
    """Map `arrays` (the copy of the weights every decode step reads, over `folder`'s image) now,
    in 2 MiB pages where the kernel can; returns {"huge": share in 2 MiB pages, "reread": bool}.

    The kernel maps a file with a 2 MiB page only where its page cache holds a 2 MiB folio
    (HUGE_PAGE), and a cache filled otherwise (memory too fragmented while the image was written,
    a small read of the file, a refill after the kernel paged the file out) keeps its small folios
    for as long as it holds the pages. Found on a 2-core Xeon whose kernel pages out file pages no
    process has mapped for a minute: 46% of the gate/up blocks mapped in 2 MiB pages, and one
    stream decoded 7% slower, eight 8% slower, than once all were. Where less than HUGE_ENOUGH
    of the arrays map huge, their pages leave the page cache (those no other process maps) and
    are read again through this huge-page map (540 MB in ~0.5 s, once); where even that leaves
    them small (no large folios on this file system, or no free 2 MiB of memory), HUGE_FILE says
    so for this boot, and later starts do not read the image again."""
    spans, libc = _spans([a for a in arrays if a.nbytes >= HUGE_PAGE]), _libc()  # those on 2 MiB boundaries
    if not spans or libc is None or not _madvise_all(libc, spans, _MADV_POPULATE_READ):
        return {"huge": None, "reread": False}
    vma, total = _vma_of(spans[0][0]), sum(hi - lo for lo, hi in spans)
    if vma is None:
        return {"huge": None, "reread": False}
    share, boot, marker = min(1.0, vma["pmd"] / total), _boot_id(), os.path.join(folder, HUGE_FILE)
    if share >= HUGE_ENOUGH or read_json_object(marker).get("boot_id") == boot:
        return {"huge": share, "reread": False}
    try:
        fd = os.open(os.path.join(folder, "weights.bin"), os.O_RDONLY)
        try:
            os.fdatasync(fd)  # a freshly written image's dirty pages cannot leave the cache
            _madvise_all(libc, spans, _MADV_DONTNEED)
            for lo, hi in spans:  # the file offsets of this map's addresses
                os.posix_fadvise(fd, lo - vma["start"] + vma["offset"], hi - lo, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except OSError:
        return {"huge": share, "reread": False}
    _madvise_all(libc, spans, _MADV_POPULATE_READ)
    vma = _vma_of(spans[0][0])
    after = min(1.0, vma["pmd"] / total) if vma else 0.0
    if after < HUGE_ENOUGH:
        note = json.dumps({"boot_id": boot, "huge": round(after, 3)}).encode()
        try:
            atomic_write(marker, lambda fh: fh.write(note))
        except OSError:
            pass  # an unwritable cache reads the image again at the next start
    return {"huge": after, "reread": True}


def _spans(arrays) -> list[tuple[int, int]]:
    """The pages under read-only arrays (over a file's map: never anonymous memory, which
    MADV_DONTNEED would zero)."""
    page = mmap.PAGESIZE
    return [(a.ctypes.data // page * page, -(-(a.ctypes.data + a.nbytes) // page) * page)
            for a in arrays if a.nbytes and not a.flags.writeable]


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _madvise_all(libc, spans: list[tuple[int, int]], advice: int) -> bool:
    done = [libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), advice) == 0 for lo, hi in spans]
    return all(done)


def _vma_of(address: int) -> dict | None:
    """The mapping of this process that holds `address`: its start, file offset and the bytes it
    maps in 2 MiB pages of a file (/proc/self/smaps)."""
    try:
        with open("/proc/self/smaps", encoding="ascii", errors="replace") as fh:
            found = None
            for line in fh:
                head = line.split(None, 3)
                if "-" in head[0] and len(head) >= 3 and not head[0].endswith(":"):
                    if found is not None:
                        return None
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    if lo <= address < hi:
                        found = {"start": lo, "offset": int(head[2], 16)}
                elif found is not None and head[0] == "FilePmdMapped:":
                    return {**found, "pmd": int(head[1]) << 10}
    except (OSError, ValueError, IndexError):
        pass
    return None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def read_json_object(path: str | None) -> dict:
    """A small JSON file's object ({} when it is missing, unreadable or not an object)."""
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def release(arrays) -> None:
    """Give back the resident pages of read-only arrays over the image's map (the layout probe's
    loser), so a copy that is never read again does not count in this process's memory."""
    libc = _libc()
    if libc is not None:
        _madvise_all(libc, _spans(arrays), _MADV_DONTNEED)
