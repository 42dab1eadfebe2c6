"""One glibc malloc arena for the process, so a prefill on an engine thread reuses its pages.

glibc gives each thread that allocates its own arena, and a thread's arena hands its freed
memory back to the OS (a 64 MB heap is unmapped once empty), so every prefill run on the
app's worker or the server's loop thread faulted its big temporaries in again: 72,000 page
faults and +200 ms on the eight-question scenario's first step (1,100 tokens), where the
same step on the main thread, whose arena keeps what it frees, faulted 3 (docs/design.md §7).
With `M_ARENA_MAX` 1 every thread allocates from the main arena. It binds only threads that
have not allocated yet, so `import engine` sets it, before any engine thread starts. A user's
own MALLOC_ARENA_MAX wins; other C libraries have no such arenas and are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_ARENA_MAX = -8  # glibc's malloc.h


def share_main_arena() -> bool:
    """Make threads created from now on allocate from the main arena; True when set."""
    if not sys.platform.startswith("linux") or os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl's mallopt is a stub
    except (OSError, AttributeError):
        return False
    return bool(libc.mallopt(M_ARENA_MAX, 1))
