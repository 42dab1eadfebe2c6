"""A decode pass's matmuls over blocks of 64 columns, shared with a helper process that spins between jobs.

BLAS runs each block's small GEMM on one core, and one core reads a layer's blocks at about
25 GB/s on a 2-core EPYC where two read 28-38 (in the engine, interleaved: eight rows' decode
steps 12-24% cheaper, one row's 2-3%). A helper thread that sleeps between jobs cannot take
half a layer's matrix: waking it cost 40-80 us there (the VM's guest halts an idle core at
once), about what it saved. So the helper is a process, started once, that spins on shared
memory as BLAS's own threads do, for SPIN_S after its last job, then sleeps on an eventfd.
Not a pipe: its "sync" wake-up put the helper on the waking caller's busy core, and every
share of the next ~30 ms was taken back (docs/design.md §7).
It maps the weight image's file itself (`share_file`), so a job is a few integers and the
input rows, and it writes its blocks into shared memory: each block is computed exactly as
it would be alone, so the answer is the same bit for bit. Passes of more than SHARE_ROWS
rows (prefill) keep BLAS's own threads; the pass's thread count sets `parts`
(engine/threads.py), so a busy machine shares nothing. A helper more than the caller's own
share's time late (asleep, or its core taken by a UI thread) has its share taken back: the
caller computes it into its own result and never reads the helper's late copy (job fields
are written under a sequence lock). While a decode pass's attention runs, the helpers read
their share of the output projection into their caches (`prefetch`), and that matmul leaves
them the larger share. A helper that dies or fails makes the caller compute its share and
stop sharing. Only on x86-64 Linux (x86's ordered stores: a job's fields land before its
sequence number; memfd_create). Run as a script, this file is the helper (it imports only NumPy).
"""

from __future__ import annotations

import functools
import mmap
import os
import platform
import sys
import threading
import time
import weakref

import numpy as np

SHARE_ROWS = 64             # passes of at most this many rows share (decode; prefill keeps BLAS's threads)
CHUNK_ROWS = 8              # BLAS's small-matrix GEMM kernel (no packing) takes 8 rows, not 28: a pass
#                             of 9-64 rows goes 8 at a time (28 rows over a layer's gate/up 1.58 -> 1.24 ms)
SHARE_BYTES = 1 << 20       # smaller matrices stay whole: a hand-off costs a few microseconds
SPIN_S = 0.002              # a helper spins this long after a job (a step's matmuls come ~0.1 ms apart)
X_FLOATS = 1 << 20          # input rows: rows x K floats
OUT_FLOATS = 8 << 20        # output: [blocks, rows, 64] floats; bigger jobs stay whole
SLOT_INTS = 32              # per helper: 0 seq (-1 while its fields are written), 1 file, 2 offset,
#                             3 blocks, 4 K, 5 rows, 6 out, 7 transposed; 8 done (its own cache line),
#                             9 failed, 10 ready, 11 sleeping; 16 started, 24 taken back (each its own line)
SLEEPING, STARTED, TAKEN = 11, 16, 24
PATIENCE_S = 20e-6          # a helper's share is taken back once it is this much (or this thread's
#                             own share's time) late: a spinning helper starts a job in ~1 us
PREFETCH_MINE = 0.25        # of a matrix the helpers read ahead, the share this thread reads from memory
#                             (a 2-core Xeon: 9 blocks, one row, from L2 in 33 us, from memory 88)
PATHS_BYTES = 1 << 16       # the shared files' paths, one per line
SLOTS_AT = PATHS_BYTES
X_AT = SLOTS_AT + 64 * SLOT_INTS * 8
OUT_AT = X_AT + X_FLOATS * 4
CTL_BYTES = OUT_AT + OUT_FLOATS * 4
SUPPORTED = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")

_F32 = np.dtype(np.float32)
_parts = 1
_files: list[tuple[str, weakref.ref, int, int]] = []  # ("dev inode path", its map, address, bytes)
_busy = threading.Lock()
_pool: _Pool | None = None
_disabled = ""                            # why sharing stopped, once it did


def set_parts(n: int) -> None:
    """Share blocks among n workers (this thread and n-1 helpers) from the next matmul on."""
    global _parts
    _parts = max(1, int(n))


def can_share(rows: int) -> bool:
    """Whether a pass of `rows` rows may share its blocks with helpers on this machine."""
    return SUPPORTED and not _disabled and rows <= SHARE_ROWS


def share_file(path: str, view: np.ndarray) -> None:
    """Let helpers read arrays that lie in `view`, a read-only map of the whole file at `path`
    (while `view` lives: every array sliced from it keeps it alive, and once it is gone its
    addresses may hold another map)."""
    st = os.stat(path)  # the helper maps this very file, not one renamed over it since
    _files.append((f"{st.st_dev} {st.st_ino} {os.path.abspath(path)}", weakref.ref(view),
                   view.ctypes.data, view.nbytes))
    if _pool is not None:
        _pool.write_paths()


def warm(n: int, timeout: float = 2.0) -> int:
    """Start the helpers of n workers and wait until they are up (at most `timeout` s: they
    come up in ~0.2 s); how many are. The layout probe measures blocks as decode runs them."""
    if n < 2 or not SUPPORTED or _disabled:
        return 0
    pool, end = _pool_or_start(), time.monotonic() + timeout
    while len(pool.ready(n - 1)) < n - 1 and time.monotonic() < end:
        time.sleep(0.005)
    return len(pool.ready(n - 1))


def matmul(x: np.ndarray, blocks: np.ndarray, transposed: bool = False) -> np.ndarray:
    """x [N, K] @ W given as blocks [nb, K, 64] (`transposed`: [nb, 64, K]): a new [N, nb*64] array."""
    if transposed and len(x) > SHARE_ROWS:  # prefill: side by side, transposed blocks are W^T [nb*64, K],
        return x @ blocks.reshape(-1, blocks.shape[2]).T   # so one GEMM (1.2x column blocks' speed here)
    K = blocks.shape[2 if transposed else 1]
    job = _rows_job(len(x), blocks, transposed) if x.dtype is _F32 and x.shape[1] == K else None
    if job is None or not _busy.acquire(blocking=False):
        return products(x, blocks, transposed).transpose(1, 0, 2).reshape(len(x), -1)  # [N, out]
    try:
        return _pool_or_start().run(x, blocks, transposed, job)
    finally:
        _busy.release()


def products(x: np.ndarray, blocks: np.ndarray, transposed: bool, out: np.ndarray | None = None):
    """x [N, K] times each block: [nb, N, 64] (into `out`); transposed blocks [nb, 64, K] as a GEMV
    each for one row, else through a view of their transpose; 9-64 rows 8 at a time, zero-padded."""
    n, K = x.shape
    if transposed and n == 1:
        return np.matmul(blocks, x[0], out=None if out is None else out[:, 0])[:, None]  # [nb, 1, 64]
    w = blocks.transpose(0, 2, 1) if transposed else blocks                           # [nb, K, 64]
    if n <= CHUNK_ROWS or n > SHARE_ROWS:
        return np.matmul(x, w, out=out)                                               # [nb, N, 64]
    chunks = np.zeros((-(-n // CHUNK_ROWS), CHUNK_ROWS, K), dtype=np.float32)         # [c, 8, K]
    chunks.reshape(-1, K)[:n] = x
    y = np.matmul(chunks, w[:, None]).reshape(len(w), -1, w.shape[2])[:, :n]         # [nb, N, 64]
    if out is not None:
        out[...] = y
    return y if out is None else out


def prefetch(blocks: np.ndarray, rows: int, transposed: bool = False) -> None:
    """Have the helpers read their share of `blocks` (the next matmul's, of `rows` rows) into their
    cores' caches while this thread does other work: a decode pass's attention, where they would
    only spin. That matmul then leaves them the larger share, from cache. Not for more than
    CHUNK_ROWS rows: their arithmetic, not the read, sets the time, and the larger share ends last."""
    job = None if _pool is None or rows > CHUNK_ROWS else _rows_job(rows, blocks, transposed)
    if job is not None and _busy.acquire(blocking=False):
        try:
            _pool.prefetch(blocks, transposed, job)
        finally:
            _busy.release()


def _rows_job(rows: int, blocks: np.ndarray, transposed: bool) -> tuple[int, int] | None:
    """(file, byte offset) of blocks a helper can read for `rows` float32 rows, or None where
    this matmul stays whole."""
    K = blocks.shape[2 if transposed else 1]
    if (_parts < 2 or not can_share(rows) or blocks.nbytes < SHARE_BYTES
            or rows * K > X_FLOATS or blocks.shape[0] * rows * 64 > OUT_FLOATS
            or blocks.dtype is not _F32 or not blocks.flags.c_contiguous):
        return None
    at = blocks.ctypes.data
    for i, (_, alive, base, size) in enumerate(_files):
        if base <= at and at + blocks.nbytes <= base + size and alive() is not None:
            return i, at - base
    return None


def _pool_or_start() -> _Pool:
    global _pool
    if _pool is None:
        _pool = _Pool()
    return _pool


class _Helper:
    """One helper process, its slot of the control block, the eventfd that wakes it and the pipe
    whose end tells it this process is gone."""

    def __init__(self, ctl_fd: int, index: int, slot: np.ndarray):
        import subprocess
        self.wake = os.eventfd(0)
        gone, self.life = os.pipe()
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(  # -P: not this folder on sys.path (its modules are not NumPy's)
            [sys.executable, "-P", os.path.abspath(__file__), *map(str, (ctl_fd, self.wake, gone, index))],
            pass_fds=(ctl_fd, self.wake, gone), env=env, stdin=subprocess.DEVNULL, close_fds=True)
        os.close(gone)
        self.slot = slot

    def post(self, seq: int, fields: tuple[int, ...]) -> None:
        self.slot[0] = -1               # a helper that read some fields before this sees them change
        self.slot[1:8] = fields
        self.slot[0] = seq              # last: x86 makes every store above visible first
        if self.slot[SLEEPING]:
            self.poke()

    def poke(self) -> None:
        os.eventfd_write(self.wake, 1)  # a dead helper is found by `collect`

    def collect(self, seq: int, patience: float) -> str:
        """"done" once the helper's share is in the output; "take" when this thread should compute
        it, the helper being `patience` seconds late (asleep, or its core taken by another thread
        such as a UI's); else what went wrong. A share taken back may still be computed by the
        helper, into the output this thread then never reads for that job."""
        spins, until = 0, 0.0
        while self.slot[8] != seq:
            spins += 1
            if spins % 64 == 0:
                now = time.perf_counter()
                until = until or now + patience
                if now > until:
                    if self.slot[STARTED] != seq:
                        self.slot[TAKEN] = seq  # the helper skips it if it has not read this far
                    return self.trouble() or "take"
        return f"helper {self.proc.pid} failed a job" if self.slot[9] else "done"

    def trouble(self) -> str:
        """Why this helper cannot take shares (its last job failed, or it died), else ""."""
        if self.slot[9]:
            return f"helper {self.proc.pid} failed a job"
        return f"helper {self.proc.pid} died" if self.proc.poll() is not None else ""


class _Pool:
    """The control block (shared memory: paths, slots, input rows, output) and the helpers."""

    def __init__(self):
        self.fd = os.memfd_create("prefixlab-split")
        os.ftruncate(self.fd, CTL_BYTES)
        self.buf = mmap.mmap(self.fd, CTL_BYTES)
        slots = np.frombuffer(self.buf, np.int64, 64 * SLOT_INTS, SLOTS_AT).reshape(64, SLOT_INTS)
        self.x = np.frombuffer(self.buf, np.float32, X_FLOATS, X_AT)
        self.out = np.frombuffer(self.buf, np.float32, OUT_FLOATS, OUT_AT)
        self.slots, self.helpers, self.seq = slots, [], 0
        self.prefetched: tuple | None = None  # (job, shape) of the blocks the helpers read ahead
        self.up = 0                           # helpers[:up] are up
        self.write_paths()

    def write_paths(self) -> None:
        text = "".join(f[0] + "\n" for f in _files).encode()[:PATHS_BYTES]
        self.buf[:len(text)] = text

    def ready(self, n: int) -> list[_Helper]:
        """The first n helpers that are up (starting any missing; they come up in ~0.2 s)."""
        while len(self.helpers) < min(n, 63):
            i = len(self.helpers)
            self.helpers.append(_Helper(self.fd, i, self.slots[i]))
        while self.up < len(self.helpers) and self.helpers[self.up].slot[10]:
            self.up += 1
        return self.helpers[:min(n, self.up)]

    def prefetch(self, blocks: np.ndarray, transposed: bool, job: tuple[int, int]) -> None:
        nb, K, C, (file, offset) = blocks.shape[0], blocks.shape[2 if transposed else 1], 64, job
        helpers = self.ready(min(_parts, nb) - 1)
        if not helpers:
            return
        cuts = shares(nb, len(helpers), True)
        self.seq += 1
        for h, lo, hi in zip(helpers, cuts[1:], cuts[2:]):
            h.post(self.seq, (file, offset + lo * K * C * 4, hi - lo, K, 0, 0, transposed))  # 0 rows: ahead
        self.prefetched = (job, blocks.shape, transposed)

    def run(self, x: np.ndarray, blocks: np.ndarray, transposed: bool, job: tuple[int, int]) -> np.ndarray:
        N, nb, K, C = x.shape[0], blocks.shape[0], blocks.shape[2 if transposed else 1], 64
        helpers = self.ready(min(_parts, nb) - 1)
        prefetched, self.prefetched = self.prefetched == (job, blocks.shape, transposed), None
        out = self.out[:nb * N * C].reshape(nb, N, C)                          # [nb, N, 64]
        cuts = shares(nb, len(helpers), prefetched)
        if helpers:
            self.x[:x.size] = x.reshape(-1)
            self.seq += 1
            file, offset = job
            for h, lo, hi in zip(helpers, cuts[1:], cuts[2:]):
                h.post(self.seq, (file, offset + lo * K * C * 4, hi - lo, K, N, lo * N * C, transposed))
        result = np.empty((N, nb, C), dtype=np.float32)                        # [N, nb, 64]
        mine = result.transpose(1, 0, 2)                                       # [nb, N, 64] view
        t0 = time.perf_counter()
        products(x, blocks[:cuts[1]], transposed, mine[:cuts[1]])
        patience = max(PATIENCE_S, time.perf_counter() - t0)
        for h, lo, hi in zip(helpers, cuts[1:], cuts[2:]):
            got = h.collect(self.seq, patience)
            if got == "done":
                mine[lo:hi] = out[lo:hi]
                continue
            if got != "take":
                _stop(got)
            products(x, blocks[lo:hi], transposed, mine[lo:hi])  # not `out`: a late helper may write there
        return result.reshape(N, nb * C)                                       # [N, out]


@functools.lru_cache(maxsize=1024)
def shares(nb: int, helpers: int, prefetched: bool) -> tuple[int, ...]:
    """Where the shares of nb blocks start: this thread's first, then each helper's, then nb;
    as even as blocks allow, or this thread's PREFETCH_MINE where the helpers read ahead."""
    mine = max(1, int(nb * PREFETCH_MINE)) if prefetched and helpers else nb // (helpers + 1)
    return (0, *(mine + (nb - mine) * i // helpers for i in range(helpers)), nb)


def _stop(why: str) -> None:
    """Stop sharing for the rest of the process."""
    global _disabled
    _disabled = why
    shutdown()


def shutdown() -> None:
    """End the helpers and free the control block (a later shared matmul starts new ones)."""
    global _pool
    pool, _pool = _pool, None
    for h in pool.helpers if pool is not None else ():
        os.close(h.life)    # a sleeping helper exits on its pipe's end, a spinning one is killed
        os.close(h.wake)
        h.proc.kill()
        h.proc.wait()
    if pool is not None:
        os.close(pool.fd)   # the map goes with the last array over it


def helper_pids() -> list[int]:
    """The helpers' process ids (engine/threads.py counts their CPU time as this process's own)."""
    return [h.proc.pid for h in _pool.helpers] if _pool is not None else []


def _forget_pool() -> None:
    global _pool
    _pool = None  # a forked child must not post jobs to its parent's helpers


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


# the helper process ----------------------------------------------------------------------
def _serve(ctl_fd: int, wake_fd: int, gone_fd: int, index: int) -> None:
    import select
    waits = select.poll()
    waits.register(wake_fd, select.POLLIN)
    waits.register(gone_fd, select.POLLIN)  # the pipe's end (POLLHUP is always reported)
    buf = mmap.mmap(ctl_fd, CTL_BYTES)
    slot = np.frombuffer(buf, np.int64, SLOT_INTS, SLOTS_AT + index * SLOT_INTS * 8)
    x = np.frombuffer(buf, np.float32, X_FLOATS, X_AT)
    out = np.frombuffer(buf, np.float32, OUT_FLOATS, OUT_AT)
    maps: list[np.ndarray] = []
    views: dict[tuple, tuple] = {}
    last = int(slot[0])
    slot[10] = 1
    while True:
        until = time.perf_counter() + SPIN_S
        while slot[0] == last or slot[0] < 0:
            os.sched_yield()        # as BLAS's threads spin: a thread that has work (a UI) runs first
            if time.perf_counter() > until:
                slot[SLEEPING] = 1
                if slot[0] == last:
                    if any(fd == gone_fd for fd, _ in waits.poll()):
                        return      # the engine's process is gone
                    os.eventfd_read(wake_fd)
                slot[SLEEPING] = 0
                until = time.perf_counter() + SPIN_S
        seq = int(slot[0])
        fields = tuple(slot[1:8].tolist())
        if seq < 0 or slot[0] != seq:
            continue                # its fields were being rewritten: read them again
        last = seq
        slot[STARTED] = seq
        if slot[TAKEN] == seq:      # the caller took this share back before it started
            continue
        try:
            if fields not in views:   # a decode step's jobs repeat: their views are made once
                if len(views) > 4096:
                    views.clear()
                views[fields] = _views(fields, maps, buf, x, out)
            products(*views[fields])
            slot[9] = 0
        except Exception:  # noqa: BLE001 - the caller computes this share itself
            slot[9] = 1
        slot[8] = seq


def _views(fields: tuple, maps: list, buf: mmap.mmap, x: np.ndarray, out: np.ndarray) -> tuple:
    """A job's `products` arguments: (input rows, its blocks, transposed, out); 0 rows is a read
    ahead, a GEMV (it reads memory fastest) whose answer goes unused."""
    file, offset, n, K, rows, at, transposed = fields
    while file >= len(maps):
        dev, ino, path = bytes(buf[:PATHS_BYTES]).split(b"\n")[len(maps)].decode().split(" ", 2)
        maps.append(np.frombuffer(_map(path, int(dev), int(ino)), dtype=np.uint8))
    w = maps[file][offset:offset + n * K * 64 * 4].view(np.float32)
    w = w.reshape((n, 64, K) if transposed else (n, K, 64))
    if not rows:
        return np.zeros((1, K), dtype=np.float32), w, bool(transposed), np.empty((n, 1, 64), dtype=np.float32)
    return x[:rows * K].reshape(rows, K), w, bool(transposed), out[at:at + n * rows * 64].reshape(n, rows, 64)


def _map(path: str, dev: int, ino: int) -> mmap.mmap:
    with open(path, "rb") as fh:
        st = os.fstat(fh.fileno())
        if (st.st_dev, st.st_ino) != (dev, ino):
            raise OSError(f"{path} was replaced since the engine mapped it")
        raw = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            raw.madvise(mmap.MADV_HUGEPAGE)   # as the engine maps it (engine/weight_image.py)
        except OSError:
            pass
    return raw


if __name__ == "__main__":
    _serve(*(int(a) for a in sys.argv[1:5]))
