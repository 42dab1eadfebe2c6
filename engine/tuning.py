"""`tune_process()`: the process-wide settings the engine runs best with, set by a program's
entry point. It imports no NumPy (nor does `import engine`): call it first thing, before
anything loads NumPy, which loads OpenBLAS, which reads its settings only then.
"""

from __future__ import annotations

import os

from .cpu.malloc import configure_malloc

# OpenBLAS's idle threads spin for 2^28 cycles (~0.1 s) after each threaded call, on the core
# a decode pass's helper process needs (engine/cpu/shared_matmul.py): after a prefill or a GEMV,
# one stream's tokens took 30-34 ms instead of 22. 2^22 cycles (~1.5 ms) still spans the gaps
# between a pass's calls. A value the user set wins.
OPENBLAS_THREAD_TIMEOUT = "22"

_tuned = False


def tune_process() -> None:
    """Shorten OpenBLAS's idle spinning (effective only before NumPy is imported) and set glibc's
    malloc to one arena with fixed thresholds (engine/cpu/malloc.py: binds the threads that have
    not allocated yet). Idempotent; the app's commands, the bench and the tools call it first."""
    global _tuned
    if _tuned:
        return
    _tuned = True
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", OPENBLAS_THREAD_TIMEOUT)
    configure_malloc()
