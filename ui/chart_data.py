"""What the charts draw: the timeline's columns in growable arrays, series names and labels."""

from __future__ import annotations

import numpy as np

from engine.metrics import TimelineRow

# Timeline columns kept per row (hit_rate is the engine row's own, not computed here).
COLUMNS = ("step", "wall_s", "capacity", "pages_private", "pages_shared", "pages_cached", "pages_free",
           "chains", "cached_pages", "queries", "hits", "hit_pages", "hit_rate", "prefill_computed",
           "prefill_saved", "decode_tokens", "disk_hits")
TIMELINE_SERIES = ("pages_private", "pages_shared", "pages_cached", "pages_free", "chains",
                   "cached_pages", "hits", "disk_hits", "hit_rate", "prefill_computed", "prefill_saved")
REQUEST_SERIES = ("ttft_hit", "ttft_no_cache", "ttft_miss")
# Where each TTFT bar sits around its request id, and how wide: a hit and its estimate without
# the cache side by side, a miss alone in the middle.
BAR_SLOTS = {"ttft_hit": (-0.19, 0.36), "ttft_no_cache": (0.19, 0.36), "ttft_miss": (0.0, 0.7)}
# Where the prompt tokens went (docs/design.md §15), cumulative over the requests admitted, one
# band a part, bottom to top in a card's bar's order (`disk` is its own band under `cached`).
PART_BANDS = ("disk", "cached", "lent", "cap", "rounding", "evicted", "isolated", "new")
PART_SERIES = tuple(f"part_{p}" for p in PART_BANDS)
SERIES = TIMELINE_SERIES + REQUEST_SERIES + PART_SERIES
CHARTS = ("pool", "cache", "hits", "prefill", "ttft", "parts")
# A row holds from its step's end until the next row: draw steps, not slopes between rows.
STEP = "right"
STACK = ("pages_private", "pages_shared", "pages_cached", "pages_free")  # bottom to top
LABELS = {
    "pages_private": "private to streams", "pages_shared": "shared", "pages_cached": "cache only",
    "pages_free": "free", "chains": "cached chains", "cached_pages": "cached pages",
    "hits": "hits (cumulative)", "disk_hits": "of them from the disk tier", "hit_rate": "hit rate (%)",
    "prefill_computed": "computed",
    "prefill_saved": "saved by the cache", "ttft_hit": "cache hit", "ttft_miss": "miss",
    "ttft_no_cache": "hit without the cache (estimate)",
    **{f"part_{p}": p for p in PART_BANDS},
}
TITLES = {"pool": "KV pool pages", "cache": "Prefix cache", "hits": "Cache hits",
          "prefill": "Prefill tokens (cumulative)", "ttft": "Time to first token per request",
          "parts": "Where the prompt tokens went"}


class TimelineBuffer:
    """Timeline columns in growable NumPy arrays (amortised O(1) append, views on read)."""

    def __init__(self, capacity: int = 256):
        self.n = 0
        self._cols = {name: np.zeros(capacity, dtype=np.float64) for name in COLUMNS}

    def clear(self) -> None:
        self.n = 0

    def extend(self, rows: list[TimelineRow]) -> None:
        k = len(rows)
        if not k:
            return
        need = self.n + k
        cap = len(self._cols["step"])
        if need > cap:
            new_cap = max(need, 2 * cap)
            for name, col in self._cols.items():
                grown = np.zeros(new_cap, dtype=np.float64)
                grown[:self.n] = col[:self.n]
                self._cols[name] = grown
        for name, col in self._cols.items():
            col[self.n:need] = [getattr(r, name) for r in rows]
        self.n = need

    def column(self, name: str) -> np.ndarray:
        """A read-only view of one column."""
        view = self._cols[name][:self.n]
        view.flags.writeable = False
        return view


def step_changes(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows where a step curve changes value, plus the last: the same picture, far fewer
    points (most counts stay flat for many steps)."""
    if len(y) < 3:
        return x, y
    keep = np.empty(len(y), dtype=bool)
    keep[0] = keep[-1] = True
    np.not_equal(y[1:-1], y[:-2], out=keep[1:-1])
    return x[keep], y[keep]
