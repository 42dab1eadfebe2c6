"""A decode pass's matmuls over blocks of 64 columns, shared with a helper process that spins between jobs.

BLAS runs each block's small GEMM on one core, and one core reads a layer's blocks at about
25 GB/s on a 2-core EPYC where two read 28-38 (in the engine, interleaved: eight rows' decode
steps 12-24% cheaper, one row's 2-3%). A helper thread that sleeps between jobs cannot take
half a layer's matrix: waking it cost 40-80 us there (the VM's guest halts an idle core at
once), about what it saved. So the helper is a process, started once, that spins on shared
memory as BLAS's own threads do, for SPIN_S after its last job, then sleeps on an eventfd.
Not a pipe: its "sync" wake-up put the helper on the waking caller's busy core, and every
share of the next ~30 ms was taken back (docs/perf-notes.md).
It maps the weight image's file itself (`share_file`), so a job is a few integers and the
input rows, and it writes its blocks into shared memory: each block is computed exactly as
it would be alone, so the answer is the same bit for bit. Passes of more than SHARE_ROWS
rows (prefill) keep BLAS's own threads; the pass's thread count sets `parts`
(engine/cpu/blas_threads.py), so a busy machine shares nothing. A helper more than the caller's own
share's time late (asleep, or its core taken by a UI thread) has its share taken back: the
caller computes it into its own result and never reads the helper's late copy (job fields
are written under a sequence lock). Each job names the pass's next matmul too: once a helper's
share is done it reads the first blocks of its share of that one into its core's caches while
this thread runs what lies between (attention, norms, the activation), and that matmul then
leaves it a larger share; how many blocks is tuned as it runs, by whether the helper had
finished reading before the next job came. Once a pass has run, this thread also posts the
next matmul's job while the helpers end this one (a Site learns which follows it), so they
take it up as soon as its input is in. A helper that dies or fails makes the caller compute
its share and stop sharing. Only on x86-64 Linux (x86's ordered stores: a job's
fields land before its sequence number; memfd_create). The helper's side is engine/cpu/helper_process.py.
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

from .helper_process import (
    AHEAD_READ,
    CHUNK_ROWS,
    CTL_BYTES,
    OUT_AT,
    OUT_FLOATS,
    PATHS_BYTES,
    READY,
    SHARE_ROWS,
    SLOT_INTS,
    SLOTS_AT,
    STARTED,
    X_AT,
    X_FLOATS,
    Handle,
    products,
)

SHARE_BYTES = 1 << 20       # smaller matrices stay whole: a hand-off costs a few microseconds
PATIENCE_S = 20e-6          # a helper's share is taken back once it is this much (or this thread's
#                             own share's time) late: a spinning helper starts a job in ~1 us
AHEAD_BYTES = 256 << 10     # what a helper first reads ahead of the next matmul; then tuned a block at a time
CACHED_COST = (0.35, 0.7)   # a block a helper read ahead costs it this much of one from memory: for
#                             one row or two (a 2-core Xeon: 9 blocks, from L2 in 33 us, from memory 88),
#                             and for more, whose arithmetic stays (8 rows: 0.35 made the step 13% slower)
NO_AHEAD = ((0, 0),) * 64     # (offset, bytes) for each helper: nothing to read ahead
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


class Site:
    """One matmul as a decode pass repeats it: its blocks and the pass's next matmul's (views
    that live as long as the weights), where each lies in a shared file, found once, and its
    shares and read-ahead for each count of rows and helpers, worked out once: a step's own
    Python runs between weight reads that empty this core's caches, and the helpers wait on it
    (docs/perf-notes.md). Which matmul follows is learned (`follow`) or given (`then`)."""

    __slots__ = ("blocks", "transposed", "then", "K", "nb", "job", "then_job", "rows", "key", "then_key",
                 "plans", "aheads", "next")

    def __init__(self, blocks: np.ndarray, transposed: bool = False, then: np.ndarray | None = None):
        self.blocks, self.transposed, self.then = blocks, transposed, then
        self.K, self.nb = blocks.shape[2 if transposed else 1], blocks.shape[0]
        self.job, self.then_job = _in_file(blocks), None if then is None else _in_file(then)
        # the most rows it shares: the control block's input and output must hold them
        most = min(SHARE_ROWS, X_FLOATS // self.K, OUT_FLOATS // (self.nb * 64))
        self.rows = most if self.job is not None and SUPPORTED else 0
        self.key = (blocks.shape, transposed)                      # what the read-ahead tuning is kept by
        self.then_key = None if then is None else (then.shape, transposed)
        self.plans: dict[tuple, tuple] = {}   # (rows, helpers, blocks read ahead) -> `shares_of`
        self.aheads: dict[tuple, tuple] = {}  # (rows, helpers, blocks to read) -> `plan`
        self.next: Site | None = None         # the Site that followed it in the last pass

    def follow(self, site: Site) -> None:
        """`site` runs after this one in a pass (learned from the last pass): the helpers read
        ahead into its blocks."""
        self.then, self.then_job = site.blocks, site.job
        self.then_key = (site.blocks.shape, self.transposed)
        self.aheads.clear()  # planned for the blocks that followed before


def matmul(x: np.ndarray, blocks: np.ndarray, transposed: bool = False,
           then: np.ndarray | None = None) -> np.ndarray:
    """x [N, K] @ W given as blocks [nb, K, 64] (`transposed`: [nb, 64, K]): a new [N, nb*64] array.
    `then`: the blocks of the pass's next matmul, which the helpers start reading once done here."""
    return matmul_site(x, Site(blocks, transposed, then))


def matmul_site(x: np.ndarray, site: Site) -> np.ndarray:
    """`matmul` of a prepared Site (a pass's matmuls repeat: engine/cpu/backend.py keeps their Sites)."""
    rows = len(x)
    if rows > SHARE_ROWS:  # prefill
        return whole_matmul(x, site)
    if (rows > site.rows or _parts < 2 or _disabled or x.dtype is not _F32 or x.shape[1] != site.K
            or not _busy.acquire(blocking=False)):  # not shared: whole, in this thread
        return products(x, site.blocks, site.transposed).transpose(1, 0, 2).reshape(rows, -1)  # [N, out]
    try:
        return _pool_or_start().run(x, site)
    finally:
        _busy.release()


def whole_matmul(x: np.ndarray, site: Site) -> np.ndarray:
    """x [N, K] @ a Site's blocks as a prefill runs it: whole, in this thread with BLAS's threads
    (never shared, never in 8-row chunks), so a row's result does not depend on how it is split."""
    if site.transposed:  # side by side, transposed blocks are W^T [nb*64, K]: one GEMM (1.2x the blocks)
        return x @ site.blocks.reshape(-1, site.K).T                                   # [N, out]
    return np.matmul(x, site.blocks).transpose(1, 0, 2).reshape(len(x), -1)             # [N, out]


def _in_file(blocks: np.ndarray) -> tuple[int, int] | None:
    """(file, byte offset) of float32 blocks a helper can read, or None where they stay whole."""
    if blocks.nbytes < SHARE_BYTES or blocks.dtype is not _F32 or not blocks.flags.c_contiguous:
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
        self.read: tuple | None = None  # (the next matmul's job, blocks, seq, tuning key, helpers):
        #                                 what the last job's helpers read ahead
        self.tuned: dict[tuple, int] = {}  # ((shape, transposed), rows) -> blocks a helper reads ahead
        self.last: Site | None = None      # the Site run last (what follows a Site is learned)
        self.pending: tuple | None = None  # (Site, seq, rows, helpers, plan, read): posted before its input
        self.up = 0                           # helpers[:up] are up
        self.write_paths()

    def write_paths(self) -> None:
        text = "".join(f[0] + "\n" for f in _files).encode()[:PATHS_BYTES]
        self.buf[:len(text)] = text

    def ready(self, n: int) -> list[Handle]:
        """The first n helpers that are up (starting any missing; they come up in ~0.2 s)."""
        if n <= self.up:
            return self.helpers[:n]
        while len(self.helpers) < min(n, 63):
            i = len(self.helpers)
            self.helpers.append(Handle(self.fd, i, self.slots[i]))
        while self.up < len(self.helpers) and self.helpers[self.up].slot[READY]:
            self.up += 1
        return self.helpers[:min(n, self.up)]

    def run(self, x: np.ndarray, site: Site) -> np.ndarray:
        N, nb, C = x.shape[0], site.nb, 64
        n = min(_parts, nb) - 1
        helpers = self.helpers[:n] if n <= self.up else self.ready(n)
        n, last, self.last, pend, self.pending = len(helpers), self.last, site, self.pending, None
        if last is not None and last.next is not site and last.then_job == site.job:
            last.next = site    # what follows `last` in a pass: posted from now on while `last` ends
        if pend is not None and pend[0] is site and pend[2] == N and pend[3] == n:
            seq, plan = pend[1], pend[4]    # posted while the last matmul ended: only its input is new
            if pend[5]:
                self.tune(pend[5])
            self.x[:x.size] = x.reshape(-1)
            for h in helpers:
                h.go(seq)
        else:
            read, self.read, seq = self.read, None, 0
            cached = self.ahead_of(read, site, N, n)
            plan = self.plan_of(site, N, n, cached)
            if n:
                if cached:
                    self.tune(read)
                self.x[:x.size] = x.reshape(-1)
                seq = self.seq = self.seq + 1
                for h, share, ahead in zip(helpers, plan[1], self.ahead(site, N, n)):
                    h.post(seq, (*share, *ahead, 0))
        cuts, posts, out, first = plan                                          # out [nb, N, 64]
        result = np.empty((N, nb, C), dtype=np.float32)                        # [N, nb, 64]
        mine = result.transpose(1, 0, 2)                                       # [nb, N, 64] view
        t0 = time.perf_counter()
        products(x, first, site.transposed, mine[:cuts[1]])
        patience = max(PATIENCE_S, time.perf_counter() - t0)
        if site.next is not None and n and all([h.ints[STARTED] == seq for h in helpers]):
            self.post_next(site.next, N, helpers)   # while the helpers end this one
        for h, lo, hi in zip(helpers, cuts[1:], cuts[2:]):
            got = h.collect(seq, patience)
            if got == "done":
                mine[lo:hi] = out[lo:hi]
                continue
            if got != "take":
                _stop(got)
            # not into `out`: a late helper may still write there
            products(x, site.blocks[lo:hi], site.transposed, mine[lo:hi])
        return result.reshape(N, nb * C)                                       # [N, out]

    def post_next(self, site: Site, rows: int, helpers: list[Handle]) -> None:
        """Post the job of `site`, the pass's next matmul, before its input: the helpers read its
        fields once done with this one and start as soon as its input is in (`go`)."""
        n = len(helpers)
        if rows > site.rows:
            return
        read, self.read = self.read, None
        cached = self.ahead_of(read, site, rows, n)
        plan = self.plan_of(site, rows, n, cached)
        seq = self.seq = self.seq + 1
        for h, share, ahead in zip(helpers, plan[1], self.ahead(site, rows, n)):
            h.post(seq, (*share, *ahead, 1))
        self.pending = (site, seq, rows, n, plan, read if cached else None)

    def plan_of(self, site: Site, rows: int, helpers: int, cached: int) -> tuple:
        """`shares_of`, kept on the Site."""
        plan = site.plans.get((rows, helpers, cached))
        if plan is None:  # a decode step's jobs repeat: their shares are worked out once
            plan = site.plans[rows, helpers, cached] = self.shares_of(site, rows, helpers, cached)
        return plan

    def shares_of(self, site: Site, rows: int, helpers: int, cached: int) -> tuple:
        """(shares, each helper's job fields, the output [nb, rows, 64] they write, this thread's
        blocks) of a matmul."""
        (file, offset), nb, K, C = site.job, site.nb, site.K, 64
        cuts = shares(nb, helpers, cached, rows)
        posts = [(file, offset + lo * K * C * 4, hi - lo, K, rows, lo * rows * C, site.transposed)
                 for lo, hi in zip(cuts[1:], cuts[2:])]
        return cuts, posts, self.out[:nb * rows * C].reshape(nb, rows, C), site.blocks[:cuts[1]]

    def ahead(self, site: Site, rows: int, helpers: int) -> tuple[tuple[int, int], ...]:
        """(byte offset, bytes) of the blocks of the pass's next matmul each helper reads once
        its share of this one is done: the first of its share of that one."""
        if site.then_job is None or rows > CHUNK_ROWS:  # more rows: their arithmetic sets the time
            return NO_AHEAD
        key = (site.then_key, rows)
        n = self.tuned.get(key, 0)
        plan = site.aheads.get((rows, helpers, n))
        if plan is None:  # once per count: a decode step's jobs repeat, each with one next
            plan = site.aheads[rows, helpers, n] = self.plan(site, key, helpers, n)
        self.read = (site.then_job, plan[0], self.seq, key, helpers) if plan[0] else None
        return plan[1]

    def plan(self, site: Site, key: tuple, helpers: int, n: int) -> tuple:
        """(blocks each helper reads ahead, each helper's (offset, bytes)) of the next matmul."""
        then, rows, (file, offset) = site.then, key[1], site.then_job
        nb, size = then.shape[0], then.nbytes // then.shape[0]
        if (file != site.job[0] or rows * then.shape[2 if site.transposed else 1] > X_FLOATS
                or nb * rows * 64 > OUT_FLOATS):  # the helpers will not share it
            return 0, NO_AHEAD
        n = n or max(1, AHEAD_BYTES // size)
        cuts = shares(nb, helpers, n, rows)
        while n > 1 and min(hi - lo for lo, hi in zip(cuts[1:], cuts[2:])) < n:  # within every share
            n -= 1
            cuts = shares(nb, helpers, n, rows)
        self.tuned[key] = n
        return n, tuple((offset + lo * size, n * size) for lo in cuts[1:-1])

    @staticmethod
    def ahead_of(read: tuple | None, site: Site, rows: int, helpers: int) -> int:
        """How many blocks of this matmul each helper read ahead (the first of its share), given
        `read`, what the last job's helpers were to read ahead: 0 where that was another's."""
        if read is None or read[0] != site.job or read[3] != (site.key, rows) or read[4] != helpers:
            return 0
        return read[1]

    def tune(self, read: tuple) -> None:
        """Tune a read-ahead by how it went: a block more where every helper had finished it before
        the job it was for came, a block fewer where one had not (it started that job late)."""
        _, n, seq, key, helpers = read
        finished = all([h.ints[AHEAD_READ] == seq for h in self.helpers[:helpers]])
        self.tuned[key] = n + 1 if finished else max(1, n - 1)


@functools.lru_cache(maxsize=1024)
def shares(nb: int, helpers: int, cached: int = 0, rows: int = 1) -> tuple[int, ...]:
    """Where the shares of nb blocks start: this thread's first, then each helper's, then nb; as
    even as blocks allow, a block a helper read ahead (`cached` each) counting CACHED_COST of one."""
    saved = (1 - CACHED_COST[rows > 2]) * cached
    mine = max(1, int((nb - helpers * saved) / (helpers + 1))) if helpers else nb
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
    """The helpers' process ids (engine/cpu/blas_threads.py counts their CPU time as this process's own)."""
    return [h.proc.pid for h in _pool.helpers] if _pool is not None else []


def _forget_pool() -> None:
    global _pool
    _pool = None  # a forked child must not post jobs to its parent's helpers


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)
