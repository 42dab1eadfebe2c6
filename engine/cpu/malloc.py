"""glibc's malloc set for an engine: one arena, fixed thresholds, so every burst reuses its memory.

Two defaults made a burst's prefill fault its big temporaries in again and again
(docs/design.md §7):
- glibc gives each thread that allocates its own arena, and a thread's arena hands its freed
  memory back to the OS (a 64 MB heap is unmapped once empty). On the app's worker the
  eight-question scenario's first step (1,100 tokens) faulted 72,000 pages and took 160-200 ms
  longer than on the main thread, which faulted 3. With `M_ARENA_MAX` 1 every thread
  allocates from the main arena.
- glibc raises its mmap and trim thresholds only once the process frees a mapped block of
  128 KB-32 MB. One fresh-clone CI run's process never had, and gave ~90 MB back to the OS
  after every burst (23,000 faults each, on every thread). The thresholds are therefore set
  where glibc's own raising ends: blocks under 32 MB come from the arena, and its top is
  trimmed above 64 MB.
The options bind threads that have not allocated yet, so `engine.tune_process()` sets them before
any engine thread starts. A user's own MALLOC_* settings win; other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for its own raised threshold (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # what glibc sets beside a raised mmap threshold
USER_SETTINGS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def configure_malloc() -> bool:
    """One arena and fixed thresholds for the allocations from now on; True when set."""
    if not sys.platform.startswith("linux") or any(os.environ.get(k) for k in USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl's mallopt is a stub
    except (OSError, AttributeError):
        return False
    return all(libc.mallopt(option, value) for option, value in (
        (M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
