"""A decode helper process (engine/cpu/shared_matmul.py runs them): the control block both sides map, the
arithmetic both sides run, the caller's handle on a helper (start, post, go, collect) and the
loop a helper runs, so both ends of a slot's protocol are in one file. Run as a script, this
file is a helper; it imports only NumPy (its folder is not on sys.path: the engine's modules
are not NumPy's).

A job is a few integers in the helper's slot and the input rows in shared memory: which
blocks of which mapped file, and which blocks of the pass's next matrix to read ahead once
this job's share is in the output (docs/design.md §7). A job can come before its input (the
caller posts the pass's next matmul while the helper ends this one): the helper then holds its
fields and starts once the caller says the input is in (GO).
"""

from __future__ import annotations

import mmap
import os
import select
import struct
import sys
import time

import numpy as np

SHARE_ROWS = 64             # passes of at most this many rows share (decode; prefill keeps BLAS's threads)
CHUNK_ROWS = 8              # BLAS's small-matrix GEMM kernel (no packing) takes 8 rows, not 28: a pass
#                             of 9-64 rows goes 8 at a time (28 rows over a layer's gate/up 1.58 -> 1.24 ms)
SPIN_S = 0.002              # a helper spins this long after a job (a step's matmuls come ~0.1 ms apart)
X_FLOATS = 1 << 20          # input rows: rows x K floats
OUT_FLOATS = 8 << 20        # output: [blocks, rows, 64] floats; bigger jobs stay whole
SLOT_INTS = 32              # per helper: 0 seq (-1 while its fields are written), 1 file, 2 offset,
#                             3 blocks, 4 K, 5 rows, 6 out, 7 transposed, 8 ahead offset, 9 ahead bytes,
#                             10 gated (the input comes later), 12 go (the seq whose input is in);
#                             then each on its own cache line: 16 done, 17 failed, 18 ready, 19 sleeping;
#                             24 started, 25 ahead read; 28 taken back
FIELDS = slice(1, 11)
GO, DONE, FAILED, READY, SLEEPING, STARTED, AHEAD_READ, TAKEN = 12, 16, 17, 18, 19, 24, 25, 28
PATHS_BYTES = 1 << 16       # the shared files' paths, one per line
SLOTS_AT = PATHS_BYTES
X_AT = SLOTS_AT + 64 * SLOT_INTS * 8
OUT_AT = X_AT + X_FLOATS * 4
CTL_BYTES = OUT_AT + OUT_FLOATS * 4
_FIELDS = struct.Struct(f"{FIELDS.stop - FIELDS.start}q")


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


class Handle:
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
        self.slot, self.ints = slot, memoryview(slot).cast("B").cast("q")

    def post(self, seq: int, fields: tuple[int, ...]) -> None:
        ints = self.ints                # the slot as a memoryview: a fifth of NumPy's cost an item
        ints[0] = -1                    # a helper that read some fields before this sees them change
        _FIELDS.pack_into(ints, 8, *fields)
        ints[0] = seq                   # last: x86 makes every store above visible first
        if ints[SLEEPING]:
            self.poke()

    def go(self, seq: int) -> None:
        """The input of job `seq`, posted before it (gated), is in."""
        ints = self.ints
        ints[GO] = seq
        if ints[SLEEPING]:
            self.poke()

    def poke(self) -> None:
        os.eventfd_write(self.wake, 1)  # a dead helper is found by `collect`

    def collect(self, seq: int, patience: float) -> str:
        """"done" once the helper's share is in the output; "take" when this thread should compute
        it, the helper being `patience` seconds late (asleep, or its core taken by another thread
        such as a UI's); else what went wrong. A share taken back may still be computed by the
        helper, into the output this thread then never reads for that job."""
        spins, until, ints = 0, 0.0, self.ints
        while ints[DONE] != seq:
            spins += 1
            if spins % 64 == 0:
                now = time.perf_counter()
                until = until or now + patience
                if now > until:
                    if self.slot[STARTED] != seq:
                        self.slot[TAKEN] = seq  # the helper skips it if it has not read this far
                    return self.trouble() or "take"
        return f"helper {self.proc.pid} failed a job" if self.slot[FAILED] else "done"

    def trouble(self) -> str:
        """Why this helper cannot take shares (its last job failed, or it died), else ""."""
        if self.slot[FAILED]:
            return f"helper {self.proc.pid} failed a job"
        return f"helper {self.proc.pid} died" if self.proc.poll() is not None else ""


def serve(ctl_fd: int, wake_fd: int, gone_fd: int, index: int) -> None:
    """Do jobs from slot `index` of the control block until the engine's process is gone."""
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
    ones = np.ones(64, dtype=np.float32)
    ints = memoryview(buf).cast("B")[SLOTS_AT + index * SLOT_INTS * 8:][:SLOT_INTS * 8].cast("q")
    slot[READY] = 1
    while True:
        if not _wait(ints, lambda last=last: ints[0] != last and ints[0] >= 0, waits, wake_fd, gone_fd):
            return                  # the engine's process is gone
        seq = ints[0]
        fields = tuple(ints[FIELDS])
        if seq < 0 or ints[0] != seq:
            continue                # its fields were being rewritten: read them again
        last = seq
        ints[STARTED] = seq
        job, (ahead_at, ahead_bytes), gated = fields[:7], fields[7:9], fields[9]
        if gated:                   # posted before its input: wait until the caller says it is in
            if not _wait(ints, lambda seq=seq: ints[GO] == seq or ints[0] != seq, waits, wake_fd, gone_fd):
                return
            if ints[GO] != seq:
                continue            # another job came instead
        if ints[TAKEN] == seq:      # the caller took this share back before it started
            continue
        try:
            if job not in views:    # a decode step's jobs repeat: their views are made once
                if len(views) > 4096:
                    views.clear()
                views[job] = _call(*_views(job, maps, buf, x, out))
            fn, args = views[job]
            fn(*args)
            ints[FAILED] = 0
        except Exception:  # noqa: BLE001 - the caller computes this share itself
            ints[FAILED] = 1
        ints[DONE] = seq
        if not ints[FAILED]:
            _ahead(maps, job, ahead_at, ahead_bytes, ones)
        ints[AHEAD_READ] = seq


def _wait(ints: memoryview, ready, waits: select.poll, wake_fd: int, gone_fd: int) -> bool:
    """Spin until ready() (for SPIN_S, yielding as BLAS's threads do: a thread that has work, a UI,
    runs first), then sleep on the eventfd until woken; False once the engine's process is gone."""
    until = time.perf_counter() + SPIN_S
    while not ready():
        os.sched_yield()
        if time.perf_counter() > until:
            ints[SLEEPING] = 1
            if not ready():
                if any(fd == gone_fd for fd, _ in waits.poll()):
                    return False
                os.eventfd_read(wake_fd)
            ints[SLEEPING] = 0
            until = time.perf_counter() + SPIN_S
    return True


def _ahead(maps: list, job: tuple, at: int, nbytes: int, ones: np.ndarray) -> None:
    """Read the next matmul's first blocks of this helper's share into this core's caches, while
    the caller runs what lies between (a GEMV reads fastest)."""
    if nbytes and job[0] < len(maps):
        maps[job[0]][at:at + nbytes].view(np.float32).reshape(-1, 64) @ ones


def _views(job: tuple, maps: list, buf: mmap.mmap, x: np.ndarray, out: np.ndarray) -> tuple:
    """A job's `products` arguments: (input rows, its blocks, transposed, out)."""
    file, offset, n, K, rows, at, transposed = job
    while file >= len(maps):
        dev, ino, path = bytes(buf[:PATHS_BYTES]).split(b"\n")[len(maps)].decode().split(" ", 2)
        maps.append(np.frombuffer(_map(path, int(dev), int(ino)), dtype=np.uint8))
    w = maps[file][offset:offset + n * K * 64 * 4].view(np.float32)
    w = w.reshape((n, 64, K) if transposed else (n, K, 64))
    return x[:rows * K].reshape(rows, K), w, bool(transposed), out[at:at + n * rows * 64].reshape(n, rows, 64)


def _call(x: np.ndarray, w: np.ndarray, transposed: bool, out: np.ndarray) -> tuple:
    """(function, arguments) that compute a job: one row over transposed blocks straight as
    `products` does it, its views made once (this runs between each job's input and its start)."""
    if transposed and len(x) == 1:
        return np.matmul, (w, x[0], out[:, 0])
    return products, (x, w, transposed, out)


def _map(path: str, dev: int, ino: int) -> mmap.mmap:
    with open(path, "rb") as fh:
        st = os.fstat(fh.fileno())
        if (st.st_dev, st.st_ino) != (dev, ino):
            raise OSError(f"{path} was replaced since the engine mapped it")
        raw = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            raw.madvise(mmap.MADV_HUGEPAGE)   # as the engine maps it (engine/cpu/weight_image.py)
        except OSError:
            pass
    return raw


if __name__ == "__main__":
    import sys
    serve(*(int(a) for a in sys.argv[1:5]))
