"""BLAS threads of the desktop app's engine worker: one core stays free for the UI thread.

OpenBLAS threads spin while they wait for each other, so a GEMM split over every core
stalls whenever the UI thread (charts, cards, page map) takes one of them, and the UI
stalls behind the spinning threads in turn. Measured by the bench's "desktop app"
section on the 2-core machine: the window ran the eight-question scenario in ~1.9x its
headless time with 2 BLAS threads. So the app's worker uses at most (usable cores - 1)
BLAS threads, at least 1. Where the engine has a process-wide thread chooser
(`engine.threads.blas_threads()`, which re-sets the count before each forward pass from
the machine's load), the cap goes into the chooser's `max_threads`; otherwise it is set
once with threadpoolctl.
"""

from __future__ import annotations

import os

UI_RESERVED_CORES = 1
_before: int | None = None  # the count (or the chooser's max_threads) before the first cap


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worker_blas_cap(cores: int | None = None) -> int:
    """The most BLAS threads the app's worker should use: every core but the UI thread's, at least 1."""
    return max(1, (cores or usable_cores()) - UI_RESERVED_CORES)


def _chooser():
    try:
        from engine.threads import blas_threads  # the engine's chooser, where it exists
    except ImportError:
        return None
    return blas_threads()


def _blas():
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="blas")


def _set(n: int | None) -> None:
    """Cap BLAS threads at n (None: back to the count before the first cap)."""
    global _before
    chooser = _chooser()
    if chooser is not None:
        old = chooser.max_threads
        chooser.max_threads = n if n is not None else (_before or old)
    else:
        blas = _blas()
        old = max((lib.num_threads for lib in blas.lib_controllers), default=None)
        target = n if n is not None else _before
        if target is not None and old is not None and old != target:
            blas.limit(limits=target)
    if n is not None and _before is None:
        _before = old


def leave_core_for_ui() -> int:
    """Cap the process's BLAS threads at `worker_blas_cap()`; return the cap."""
    cap = worker_blas_cap()
    _set(cap)
    return cap


def release_core() -> None:
    """Undo `leave_core_for_ui` (the bench's headless rounds share the app's process)."""
    _set(None)
