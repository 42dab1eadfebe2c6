"""The one resident layout of the matmul weights: 64-column blocks (docs/design.md §11).

A [K, N] weight is held as [N/64, K, 64], each block contiguous. Measured on NumPy's
OpenBLAS (SkylakeX kernel, 2-core AMD EPYC), one thread, the model's five shapes:
one row's GEMV over the blocks reads as fast as over the plain [K, N] array (25.7 vs
25.8 ms a step), 8 rows cost 29 ms over the blocks but 90 ms as one plain GEMM (whose
packing of B runs at a third of the bandwidth), and strided views of the plain array
or a transposed [N, K] copy gain nothing. So the blocks serve every batch size and
no second copy of the weights is kept.
"""

from __future__ import annotations

import os
import threading

import numpy as np

COLUMN_BLOCK = 64


class _Helper:
    """One persistent thread that multiplies the second half of the blocks while the caller
    does the first: OpenBLAS gives a 64-column block one core at best, so two cores read
    the weights only when two threads each take half of the blocks."""

    def __init__(self):
        self._go, self._done = threading.Lock(), threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._job: tuple | None = None
        self._error: BaseException | None = None
        threading.Thread(target=self._loop, name="column-blocks", daemon=True).start()

    def _loop(self) -> None:
        while True:
            self._go.acquire()
            try:
                np.matmul(*self._job[:2], out=self._job[2])
            except BaseException as e:  # noqa: BLE001 - handed to the caller in join()
                self._error = e
            self._done.release()

    def start(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        self._job = (a, b, out)
        self._go.release()

    def join(self) -> None:
        self._done.acquire()
        self._job = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


_ways = 1                        # threads that share each column-block matmul (engine/threads.py sets it)
_helper: _Helper | None = None
_helper_lock = threading.Lock()  # the helper serves one matmul at a time


def set_ways(n: int) -> None:
    """Split each column-block matmul between `n` threads (1 or 2; the BLAS then runs 1 thread)."""
    global _ways, _helper
    _ways = min(2, max(1, int(n)))
    if _ways > 1 and _helper is None:
        _helper = _Helper()


def _after_fork_in_child() -> None:
    # a forked child has no helper thread: a split there would wait for it forever
    global _ways, _helper, _helper_lock
    _ways, _helper, _helper_lock = 1, None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def ways() -> int:
    """Threads each column-block matmul is split between now."""
    return _ways


def _blocks_matmul(a: np.ndarray, blocks: np.ndarray, out: np.ndarray) -> np.ndarray:
    """np.matmul(a, blocks, out=out) over [nb, K, 64] blocks, halves on two threads when set."""
    nb = blocks.shape[0]
    if _ways < 2 or nb < 2 or not _helper_lock.acquire(blocking=False):
        return np.matmul(a, blocks, out=out)
    try:
        h = nb // 2
        _helper.start(a, blocks[h:], out[h:])
        np.matmul(a, blocks[:h], out=out[:h])
        _helper.join()
    finally:
        _helper_lock.release()
    return out


def to_column_blocks(w: np.ndarray) -> np.ndarray | None:
    """w [..., K, N] as [..., N/64, K, 64] contiguous column blocks; None when N % 64 != 0."""
    *lead, K, N = w.shape
    if N % COLUMN_BLOCK:
        return None
    return np.ascontiguousarray(w.reshape(*lead, K, N // COLUMN_BLOCK, COLUMN_BLOCK).swapaxes(-3, -2))


class ColumnBlocks:
    """A float32 [..., K, N] matrix stored as [..., N/64, K, 64]; `x @ W` through `matmul`."""

    __slots__ = ("blocks",)
    __array_ufunc__ = None  # `x @ blocks` would silently build the plain copy: use matmul()

    def __init__(self, blocks: np.ndarray):
        self.blocks = blocks  # [..., N/64, K, 64]

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, nb, K, c = self.blocks.shape
        return (*lead, K, nb * c)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    @property
    def size(self) -> int:
        return self.blocks.size

    @property
    def dtype(self) -> np.dtype:
        return self.blocks.dtype

    def __getitem__(self, index: int) -> ColumnBlocks:
        return ColumnBlocks(self.blocks[index])  # one layer of a stacked weight

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        *lead, nb, K, c = self.blocks.shape
        plain = self.blocks.swapaxes(-3, -2).reshape(*lead, K, nb * c)
        return plain if dtype is None else plain.astype(dtype)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x [n, K] @ W [K, N] -> [n, N] for a 2-D W."""
        nb, _, c = self.blocks.shape
        if len(x) == 1:  # a GEMV per block, written straight into [N/64, 64] = [N] order
            return _blocks_matmul(x[0], self.blocks, np.empty((nb, c), np.float32)).reshape(1, -1)
        out = _blocks_matmul(x, self.blocks, np.empty((nb, len(x), c), np.float32))  # [nb, n, 64]
        return out.transpose(1, 0, 2).reshape(len(x), -1)                      # [n, N]

    @property
    def T(self) -> BlockRows:
        return BlockRows(self)


class BlockRows:
    """The rows of W.T [N, K] of a 2-D ColumnBlocks: a tied output head read as the embedding."""

    __slots__ = ("source",)

    def __init__(self, source: ColumnBlocks):
        self.source = source

    @property
    def shape(self) -> tuple[int, int]:
        K, N = self.source.shape
        return (N, K)

    @property
    def T(self) -> ColumnBlocks:
        return self.source

    def __getitem__(self, rows) -> np.ndarray:
        rows = np.asarray(rows)
        return self.source.blocks[rows // COLUMN_BLOCK, :, rows % COLUMN_BLOCK]  # [..., K]

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        plain = np.asarray(self.source).T
        return plain if dtype is None else plain.astype(dtype)


def matmul(x: np.ndarray, w) -> np.ndarray:
    """x [n, K] @ w [K, N] -> [n, N], w plain or ColumnBlocks."""
    if isinstance(w, ColumnBlocks):
        return w.matmul(x)
    if len(x) == 1:
        return (x[0] @ w)[None]
    return x @ w
