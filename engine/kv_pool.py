"""A paged KV pool: the BlockManager's pages backed by K and V arrays for every layer."""

from __future__ import annotations

import numpy as np

from .block_manager import BlockManager, Session
from .config import ModelConfig

__all__ = ["KVPool", "Session"]


class KVPool(BlockManager):
    """Pages of `page_rows` positions; K/V arrays are [layers, pages, rows, kv_heads, head_dim].

    With `max_pages=None` the pool grows by doubling (the arrays grow with the page ids);
    otherwise it is bounded and, when empty, asks its prefix caches to give pages back.
    """

    def __init__(self, cfg: ModelConfig, page_rows: int = 16, max_pages: int | None = None):
        super().__init__(page_rows=page_rows, max_pages=max_pages)
        self.cfg = cfg
        self.k = self._zeros(self.capacity)
        self.v = self._zeros(self.capacity)

    def _zeros(self, n: int) -> np.ndarray:
        c = self.cfg
        return np.zeros((c.n_layers, n, self.page_rows, c.n_kv_heads, c.head_dim), dtype=np.float32)

    def _on_grow(self, old: int, new: int) -> None:
        self.k = np.concatenate([self.k, self._zeros(new - old)], axis=1)
        self.v = np.concatenate([self.v, self._zeros(new - old)], axis=1)
