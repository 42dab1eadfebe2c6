"""A paged KV pool: the BlockManager's pages backed by K and V arrays for every layer."""

from __future__ import annotations

import math
import mmap

import numpy as np

from .block_manager import BlockManager, Session
from .config import ModelConfig

__all__ = ["KV_DTYPES", "KVPool", "Session", "kv_dtype_name"]

# Storage types of K/V pages: float16 halves the bytes per page; attention always computes in
# float32 (a float16 page is widened as it is read), so a hit and a miss read the same values.
KV_DTYPES = {"float32": np.float32, "float16": np.float16}
_ALIASES = {"f32": "float32", "fp32": "float32", "f16": "float16", "fp16": "float16"}


def kv_dtype_name(name: str) -> str:
    """The canonical name of a KV dtype ("float32", "float16"; "f16", "fp16", ... accepted)."""
    canon = _ALIASES.get(str(name).lower(), str(name).lower())
    if canon not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {name!r}; one of float32 (f32), float16 (f16)")
    return canon


class KVPool(BlockManager):
    """Pages of `page_rows` positions; K/V arrays are [layers, pages, rows, kv_heads, head_dim].

    With `max_pages=None` the pool grows by doubling (the arrays grow with the page ids);
    otherwise it is bounded and, when empty, asks its prefix caches to give pages back.
    `kv_dtype` ("float32" or "float16") is how K and V are stored.
    """

    def __init__(self, cfg: ModelConfig, page_rows: int = 16, max_pages: int | None = None,
                 kv_dtype: str = "float32"):
        super().__init__(page_rows=page_rows, max_pages=max_pages)
        self.cfg = cfg
        self.kv_dtype = kv_dtype_name(kv_dtype)
        self.k = self._zeros(self.capacity)
        self.v = self._zeros(self.capacity)

    @property
    def bytes_per_page(self) -> int:
        """K and V of one page, every layer."""
        c = self.cfg
        return 2 * c.n_layers * self.page_rows * c.n_kv_heads * c.head_dim * self.k.itemsize

    def _zeros(self, n: int) -> np.ndarray:
        c = self.cfg
        return small_page_zeros((c.n_layers, n, self.page_rows, c.n_kv_heads, c.head_dim),
                                KV_DTYPES[self.kv_dtype])

    def _on_grow(self, old: int, new: int) -> None:
        k, v = self._zeros(new), self._zeros(new)
        k[:, :old], v[:, :old] = self.k, self.v
        self.k, self.v = k, v


def small_page_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Zeros in an anonymous mapping the OS backs with small pages as they are first written.

    NumPy asks Linux for 2 MB pages for every array of 4 MB or more, but a pool is written a
    few KB at a time in each layer's slab, so each first write zeroed a whole 2 MB page
    (docs/design.md §3): on a 2-core EPYC VM a fresh 1,100-token prefill's K/V writes took
    300 ms instead of 30, and the eight-question run peaked at 776 MB instead of 657 MB."""
    count = math.prod(shape)
    buf = mmap.mmap(-1, max(1, count * np.dtype(dtype).itemsize))  # zero-filled, lazily backed
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)
