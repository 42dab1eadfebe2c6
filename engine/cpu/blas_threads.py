"""BLAS threads that fit the machine: never more than the cores other processes leave free.

OpenBLAS starts one thread per core and its threads spin while they wait. When another
process keeps a core busy, a two-thread GEMM waits for the slower thread on every call:
measured here, a decode step went from 70 ms (1 thread) to 900 ms (2 threads) with two
busy processes on the 2-core machine. So before each forward pass the engine asks how
many cores the rest of the machine leaves free (from /proc/stat, minus this process's own
CPU time) and sets the BLAS thread count to that, at least 1.
"""

from __future__ import annotations

import os
import time

from . import shared_matmul

# Passes of these many rows gain nothing from a second BLAS thread here: a decode step of 2-63
# rows is bound by reading the weights (8 rows: 24 ms with one thread, 25 with two), while one
# row's GEMV (35 -> 46 tok/s) and a prefill's GEMMs (362 -> 596 tok/s) do gain.
BANDWIDTH_ROWS = range(2, 64)
SAMPLE_S = 0.5        # re-read the machine's load at most this often
FIRST_SAMPLE_S = 0.1  # the first window may be shorter: it replaces the load average's guess
_PROC_STAT = "/proc/stat"


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _env_threads() -> int | None:
    """A thread count the user set for OpenBLAS (it caps ours), or None."""
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def _busy_seconds() -> float | None:
    """Seconds of CPU time every core of the machine has spent busy since boot (Linux)."""
    try:
        with open(_PROC_STAT, encoding="ascii") as fh:
            fields = fh.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]     # user nice system idle iowait irq softirq steal
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def _load_average() -> float:
    """Runnable processes averaged over the last minute (0 where the OS does not say)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def _own_seconds() -> float:
    """CPU seconds of this process and its helper processes (engine/cpu/shared_matmul.py),
    which are its own work."""
    t = os.times()
    return t.user + t.system + sum(map(_cpu_seconds, shared_matmul.helper_pids()))


def _cpu_seconds(pid: int) -> float:
    """CPU seconds process `pid` has used (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def load_sample() -> tuple[float, float | None, float]:
    """(now, the machine's busy CPU seconds, this process's own): two of them give `others_cores`."""
    return time.monotonic(), _busy_seconds(), _own_seconds()


def others_cores(first: tuple, last: tuple) -> float | None:
    """Cores other processes kept busy, on average, between two load samples (None: unknown)."""
    (t0, busy0, own0), (t1, busy1, own1) = first, last
    if busy0 is None or busy1 is None or t1 <= t0:
        return None
    return max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)


class BlasThreads:
    """Chooses and sets the BLAS thread count for each forward pass."""

    def __init__(self, max_threads: int | None = None):
        from threadpoolctl import ThreadpoolController
        self.cores = usable_cores()
        self._controller = ThreadpoolController().select(user_api="blas")
        self.max_threads = max(1, min(max_threads or self.cores, self.cores, _env_threads() or self.cores))
        self.pinned: int | None = None  # a fixed count (the bench's 1-thread diagnostic)
        # at most this many threads on BANDWIDTH_ROWS passes (the app keeps a core for its UI)
        self.batch_cap: int | None = None
        self._current: int | None = None
        self._sample = load_sample()
        self._measured = False
        # cores the other processes left free in the last window. Before the first window the
        # load average guesses; it lags a minute, so the runs just before this one (a script
        # calling `prefixlab run` in a loop) would cost the first steps half their threads.
        self.free = max(0.0, float(self.cores) - _load_average())

    def _refresh(self) -> None:
        if time.monotonic() - self._sample[0] < (SAMPLE_S if self._measured else FIRST_SAMPLE_S):
            return
        first, self._sample = self._sample, load_sample()
        others = others_cores(first, self._sample)
        if others is None:
            return
        self._measured = True
        total = os.cpu_count() or self.cores
        self.free = max(0.0, min(float(self.cores), total - others))

    def choose(self, rows: int = 1, capped: bool = True) -> int:
        """Threads for the next forward pass of `rows` rows: the free cores, at least 1
        (`capped`: at most `batch_cap` on BANDWIDTH_ROWS passes, for BLAS's spinning threads)."""
        if self.pinned is not None:
            return self.pinned
        self._refresh()
        cap = self.max_threads
        if capped and self.batch_cap is not None and rows in BANDWIDTH_ROWS:
            cap = min(cap, self.batch_cap)
        return max(1, min(cap, int(self.free + 0.35)))

    def fit(self, rows: int = 1, blocks: bool = False) -> int:
        """Set the BLAS thread count for the next forward pass of `rows` rows (only when it
        changes) and the workers that share its column blocks (`blocks`: the model reads that
        layout). A decode pass over blocks runs BLAS on one thread and shares its blocks with
        spinning helper processes (engine/cpu/shared_matmul.py) on the other free cores, where BLAS's own
        threads would only fight them for those cores."""
        parts = self.choose(rows, capped=False) if blocks and shared_matmul.can_share(rows) else 1
        n = 1 if parts > 1 else self.choose(rows)
        if n != self._current:
            self._limit(n)
            self._current = n
        shared_matmul.set_parts(parts)
        return n

    def _limit(self, n: int) -> None:
        # threadpoolctl >= 3.8 lets only the first thread that set OpenBLAS's (process-wide) count
        # set it again, and silently ignores every other thread. The engine's passes run on the
        # thread that drives its loop (the app's worker, the server's), one thread at a time, so
        # each pass takes control: else the app's prefill ran on the one thread the main thread's
        # last decode pass had set (1.7x slower, and the app 1.09x headless for that alone).
        for lib in self._controller.lib_controllers:
            clear = getattr(lib, "clear_controlling_thread", None)
            if clear is not None:
                clear(force=True)
        self._controller.limit(limits=n)


_default: BlasThreads | None = None


def blas_threads() -> BlasThreads:
    """The process-wide chooser (BLAS thread counts are global to the process)."""
    global _default
    if _default is None:
        _default = BlasThreads()
    return _default
