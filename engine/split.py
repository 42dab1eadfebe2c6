"""A big matmul over column blocks shared among threads: BLAS runs each block's small GEMM on one core.

A matmul over [nb, K, 64] blocks is nb small GEMMs that NumPy runs one after another with the GIL
released, so `parts` threads (the caller and parts-1 helpers) can each take a contiguous share of
the blocks and write it into one output, each block computed exactly as it would be alone. Handing
a share to a helper costs a thread wake-up (50-100 us measured on a 2-core VM), so only matrices
of SPLIT_BYTES or more are shared: the output head, whose 113 MB took 7.8 ms for 8 rows on one
core and 5.4 ms on two (2 rows: 5.3 -> 3.9 ms); a layer's 2-7 MB matrices lost as much as they won.
The pass's BLAS thread count sets `parts` (engine/threads.py), so a busy machine shares less. A
second caller while a share runs (another thread's forward pass) runs its matmul whole.
"""

from __future__ import annotations

import os
import queue
import threading

import numpy as np

SPLIT_BYTES = 32 << 20
_parts = 1
_helpers: list[tuple[queue.SimpleQueue, queue.SimpleQueue]] = []
_busy = threading.Lock()


def set_parts(n: int) -> None:
    """Share blocks among n threads from the next matmul on."""
    global _parts
    _parts = max(1, int(n))


def _serve(jobs: queue.SimpleQueue, done: queue.SimpleQueue) -> None:
    while True:
        x, blocks, out = jobs.get()
        try:
            np.matmul(x, blocks, out=out)
            done.put(None)
        except Exception as e:  # noqa: BLE001 - handed to the caller, who raises it
            done.put(e)


def _ensure(n: int) -> list[tuple[queue.SimpleQueue, queue.SimpleQueue]]:
    while len(_helpers) < n:
        pair = (queue.SimpleQueue(), queue.SimpleQueue())
        threading.Thread(target=_serve, args=pair, name="prefixlab-blocks", daemon=True).start()
        _helpers.append(pair)
    return _helpers[:n]


def _forget_helpers() -> None:
    _helpers.clear()  # a forked child has none of its parent's threads


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helpers)


def matmul(x: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """np.matmul(x [N, K], blocks [nb, K, 64]) -> [nb, N, 64], the blocks shared among threads."""
    nb = blocks.shape[0]
    parts = min(_parts, nb)
    if parts < 2 or blocks.nbytes < SPLIT_BYTES or not _busy.acquire(blocking=False):
        return np.matmul(x, blocks)
    try:
        out = np.empty((nb, x.shape[0], blocks.shape[-1]), dtype=np.result_type(x, blocks))  # [nb, N, 64]
        cuts = [nb * i // parts for i in range(parts + 1)]
        helpers = _ensure(parts - 1)
        for (jobs, _), lo, hi in zip(helpers, cuts[1:], cuts[2:]):
            jobs.put((x, blocks[lo:hi], out[lo:hi]))
        try:
            np.matmul(x, blocks[:cuts[1]], out=out[:cuts[1]])
            errors = [None]
        except Exception as e:  # noqa: BLE001 - raised below, once every helper has answered
            errors = [e]
        errors += [done.get() for _, done in helpers]
    finally:
        _busy.release()
    for e in errors:
        if e is not None:
            raise e
    return out
