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
from .shared_matmul import Site, whole_matmul
from .weight_image import release, settle_huge
from .weight_layout import BLOCKS, COLUMN_BLOCK, plain_matmul, probe_arrays, site_matmul
from .weight_layout import choose as choose_layout

if TYPE_CHECKING:
    from ..loader import Weights

BLOCKED_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down", "output_t")
LAYER_WEIGHTS = BLOCKED_WEIGHTS[:4]  # a block's matmuls: what a prompt pass pads (prompt_linear)
PROBE_ROWS = (2, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 64, 96, 128)  # the paddings exact_rows tries
PROBE_BIG = 160  # the long pass the probe's shorter ones must equal, row for row
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
        self.exact_rows = PROBE_ROWS[-1]  # a prompt pass pads to this many rows (probe_exact_rows)
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
        self.exact_rows = self.probe_exact_rows()

    def probe_exact_rows(self) -> int:
        """The fewest rows (of PROBE_ROWS) whose pass computes every row of a layer's matmuls
        exactly as a PROBE_BIG-row pass does, on random rows: BLAS switches kernels (and so its
        order of summing) with the row count, at a count that depends on the CPU (docs/perf-notes.md)."""
        blas_threads().fit(PROBE_BIG)  # a prefill's threads, no more than the free cores (else 3-6x slower)
        rng = np.random.default_rng(0)
        xs = {K: rng.standard_normal((PROBE_BIG, K), dtype=np.float32) for K in map(self._k, LAYER_WEIGHTS)}
        refs = {n: self._whole(xs[self._k(n)], n, 0) for n in LAYER_WEIGHTS}
        for rows in PROBE_ROWS:
            # this count and one a few rows past it (every count above must agree, not one)
            if all(np.array_equal(self._whole(xs[self._k(n)][:r], n, 0), refs[n][:r])
                   for n in LAYER_WEIGHTS for r in (rows, rows + 5)):
                return rows
        return PROBE_ROWS[-1]

    def _k(self, name: str) -> int:
        """The inner dimension of matrix `name`'s products."""
        blocks = self.blocks(name)
        if blocks is None:
            return getattr(self.weights, name).shape[-2]
        return blocks.shape[-1] if self.transposed else blocks.shape[-2]

    def _whole(self, x: np.ndarray, name: str, layer: int | None) -> np.ndarray:
        """x [N, K] @ weight `name` as one GEMM in this thread, the way a long prefill's rows go."""
        site = self._sites.get((self.layout, name, layer)) or self.site(name, layer)
        if site is None:
            return x @ layer_of(getattr(self.weights, name), layer)                 # [N, out]
        return whole_matmul(x, site)                                             # [N, out]

    def prompt_linear(self, x: np.ndarray, name: str, layer: int | None = None) -> np.ndarray:
        """`linear` for a pass that holds prompt rows: every row computed as in any other prompt
        pass, long or short, so a prefix cache hit's tail equals the same rows of a miss bit for
        bit (docs/perf-notes.md, "Hit == miss"). Fewer than `exact_rows` rows are padded with
        zero rows up to it (BLAS's small-matrix kernel sums in another order), and no pass is
        split into 8-row chunks, shared with the helpers or taken as a GEMV."""
        n = len(x)
        if n < self.exact_rows:
            padded = np.zeros((self.exact_rows, x.shape[1]), dtype=np.float32)   # [P, K]
            padded[:n] = x
            return self._whole(padded, name, layer)[:n]                          # [N, out]
        return self._whole(x, name, layer)                                       # [N, out]

    def begin_pass(self, rows: int, prompt: bool = False) -> None:
        """A forward pass of `rows` rows starts on this thread: no more BLAS threads than the
        machine's free cores, and its blocks shared with helpers where that pays (blas_threads.fit);
        a `prompt` pass (prompt_linear) shares none: it runs on BLAS's threads, as a prefill does."""
        blas_threads().fit(rows, self.reads_blocks and not prompt)
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

    def head(self, h: np.ndarray, prompt: bool) -> np.ndarray:
        """The output head, h [B, d] @ output_t: logits [B, vocab]. A prompt pass never takes one
        row of it the way a decode pass may: a GEMV rounds unlike a GEMM of several rows, so a hit's
        last row beside decoding streams would differ from the miss's, alone in its pass
        (docs/perf-notes.md, "Hit == miss"). Over blocks, one row goes as a pair, as several rows
        go; over the plain layout, where a GEMM of a few rows packs the whole head (5x a GEMV's
        time), every row goes alone as a GEMV."""
        if not prompt:
            return self.linear(h, "output_t")                                  # [B, vocab]
        site = self.site("output_t")
        if site is not None:
            return site_matmul(h, site, "pair")                                # [B, vocab]
        w = self.weights.output_t
        return np.concatenate([plain_matmul(h[i:i + 1], w) for i in range(len(h))])   # [B, vocab]

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
