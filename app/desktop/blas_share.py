"""BLAS threads of the desktop app's engine worker: one core stays free for the UI thread.

OpenBLAS threads spin while they wait for each other, so a GEMM split over every core
stalls whenever the UI thread (charts, cards, page map) takes one of them, and the UI
stalls behind the spinning threads in turn. Where a second thread buys nothing, on decode
passes of 2-63 rows that only wait for memory, the worker leaves that core to the UI
(the engine chooser's `batch_cap`); one row's GEMV and a prefill's GEMMs still use every
free core, since they run 1.3-1.6x faster on two (measured by the bench's "desktop app"
section: the eight-question scenario in the window 1.17-1.2x its headless time with one
thread on every pass, against 1.17x for headless itself pinned to one thread).
Over column blocks a decode pass runs BLAS on one thread anyway and shares its blocks with a
helper process on the other core, in the window too (engine/cpu/shared_matmul.py): the window ran the
scenario in 3.15-3.31 s with it against 3.45 s before it, though headless gained more, as the
UI thread now competes with the helper for that core.
"""

from __future__ import annotations

from engine.cpu.blas_threads import blas_threads, usable_cores

UI_RESERVED_CORES = 1


def worker_blas_cap(cores: int | None = None) -> int:
    """The most BLAS threads the app's worker should use: every core but the UI thread's, at least 1."""
    return max(1, (cores or usable_cores()) - UI_RESERVED_CORES)


def leave_core_for_ui() -> int:
    """Cap the worker's bandwidth-bound passes at `worker_blas_cap()` threads; return the cap."""
    cap = worker_blas_cap()
    blas_threads().batch_cap = cap
    return cap


def release_core() -> None:
    """Undo `leave_core_for_ui` (the bench's headless rounds share the app's process)."""
    blas_threads().batch_cap = None
