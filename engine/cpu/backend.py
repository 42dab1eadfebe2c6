"""The CPU backend: the copy of the weights a forward pass reads, and the matmuls over it.

A forward pass says that a pass of N rows begins (`begin_pass`), then asks for `linear(x,
name, layer)` and `embed(tokens)`. Everything else stays in here: which layout is read
(weight_layout.py), which matmuls are shared with helper processes (shared_matmul.py) and how
many BLAS threads run (blas_threads.py). The order of a pass's matmuls is learned, not told:
each matmul's Site records the Site that ran after it in the last pass, and the helpers read
ahead into that one once done with their share (docs/design.md §7).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np

from .blas_threads import blas_threads
from .shared_matmul import Site
from .weight_image import release, settle_huge
from .weight_layout import BLOCKS, COLUMN_BLOCK, plain_matmul, probe_arrays, site_matmul
from .weight_layout import choose as choose_layout

if TYPE_CHECKING:
    from ..loader import Weights

BLOCKED_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down", "output_t")
SMALL_MODEL_BYTES = 16 << 20  # matrices this small sit in the caches: either layout does, plain stays


def layer_of(a: np.ndarray | None, layer: int | None) -> np.ndarray | None:
    """One layer's array of a stacked one; the array itself for None (not per layer)."""
    return a if a is None or layer is None else a[layer]


class _Pass(threading.local):
    """One thread's forward pass, as the backend follows it."""

    last: Site | None = None  # the Site run last (None: the pass's first matmul is next)


class CpuBackend:
    """One model's weights as this machine reads them fastest, and the matmuls of its passes.

    The one copy a forward pass reads (`layout`): "plain", the Weights' own arrays, or the
    image's blocks of BLOCKED_WEIGHTS, "blocks" ([L,] N/64, K, 64) or "blocks_t" ([L,] N/64,
    64, K). The other copies stay on disk, unread, so they never become resident.
    """

    def __init__(self, weights: Weights, block_copies: dict[str, dict[str, np.ndarray]] | None = None):
        self.weights = weights
        self.block_copies = block_copies or {}  # kind -> {name: blocks}
        self.layout = "plain"
        self.layout_record: dict = {}  # how the layout was chosen
        self.one_row = "pair"          # how one row reads the blocks: weight_layout.ONE_ROW, as measured
        self.pages: dict = {}          # how the copy read is mapped (settle_huge)
        self._sites: dict[tuple, Site] = {}  # (layout, name, layer) -> its Site, made once
        self._pass = _Pass()

    @property
    def reads_blocks(self) -> bool:
        """Whether a forward pass reads blocks (shared with the decode helpers), not the plain arrays."""
        return self.layout in BLOCKS

    @property
    def transposed(self) -> bool:
        """Whether the blocks read are transposed ("blocks_t")."""
        return self.layout == "blocks_t"

    def blocks(self, name: str) -> np.ndarray | None:
        """`name`'s blocks when they are the copy read, else None (read the plain array)."""
        return self.block_copies.get(self.layout, {}).get(name)

    def read_copy(self, name: str) -> np.ndarray:
        """The array a forward pass reads for matrix `name`: its blocks, else the plain one."""
        blocks = self.blocks(name)
        return blocks if blocks is not None else getattr(self.weights, name)

    def choose_layout(self, folder: str) -> None:
        """Read the layout this machine runs fastest (weight_layout.py), remembered in `folder`;
        then map the copy read, in 2 MiB pages where the kernel can (weight_image.settle_huge)."""
        w = self.weights
        if self.block_copies and w.matmul_bytes() >= SMALL_MODEL_BYTES:
            layers = {n: getattr(w, n) for n in ("wqkv", "wo", "w_gate_up", "w_down")}
            probed = probe_arrays(layers, self.block_copies)
            self.layout, self.layout_record = choose_layout(folder, probed)
            self.one_row = self.layout_record["one_row"]
            if self.layout_record["source"] == "measured":  # the losers' probed pages leave memory
                for kind, arrays in probed.items():
                    if kind != self.layout:
                        release(arrays)
        self.pages = settle_huge(folder, [self.read_copy(n) for n in BLOCKED_WEIGHTS])

    def begin_pass(self, rows: int) -> None:
        """A forward pass of `rows` rows starts on this thread: no more BLAS threads than the
        machine's free cores, and its blocks shared with helpers where that pays (blas_threads.fit)."""
        blas_threads().fit(rows, self.reads_blocks)
        self._pass.last = None  # the first matmul of a pass follows none

    def linear(self, x: np.ndarray, name: str, layer: int | None = None) -> np.ndarray:
        """x [N, K] @ weight `name` (`layer`'s when given): [N, out], in the layout read."""
        site = self._sites.get((self.layout, name, layer)) or self.site(name, layer)
        now = self._pass  # this thread's pass: its last Site
        last, now.last = now.last, site
        if site is None:
            return plain_matmul(x, layer_of(getattr(self.weights, name), layer))   # [N, out]
        if last is not None and last.then is not site.blocks:
            last.follow(site)  # the pass's order, learned: helpers read ahead into what comes next
        return site_matmul(x, site, self.one_row)                                # [N, out]

    def site(self, name: str, layer: int | None = None) -> Site | None:
        """The matmul of `name` (`layer`'s) as decode repeats it, where blocks are the copy read."""
        key = (self.layout, name, layer)
        site = self._sites.get(key)
        if site is None:
            blocks = self.blocks(name)
            if blocks is None:
                return None
            site = self._sites[key] = Site(layer_of(blocks, layer), self.transposed)
        return site

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """Embedding rows [N, d]; a tied embedding is read from the head's copy that is read."""
        w = self.weights
        head = self.blocks("output_t") if w.token_embd is w.output else None
        if head is None:
            return np.asarray(w.token_embd[tokens], dtype=np.float32)          # [N, d]
        if self.transposed:
            return head[tokens // COLUMN_BLOCK, tokens % COLUMN_BLOCK]        # [N, d]
        return head[tokens // COLUMN_BLOCK, :, tokens % COLUMN_BLOCK]        # [N, d]
