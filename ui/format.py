"""Numbers as the window shows them: counts, sizes, durations and the pool's one-line summary."""

from __future__ import annotations

import numpy as np

from engine.metrics import PAGE_CACHED, PAGE_FREE, PAGE_PRIVATE, PAGE_SHARED


def format_count(n: int) -> str:
    """135_000_000 -> '135M'; 1_700_000_000 -> '1.7B'."""
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            value = n / div
            return f"{value:.1f}{suffix}" if value < 10 else f"{value:.0f}{suffix}"
    return str(n)


def format_bytes(n: int) -> str:
    for div, suffix in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= div:
            return f"{n / div:.1f} {suffix}"
    return f"{n} B"


def secs(s: float | None) -> str:
    """The one duration format: 0.2 -> '200 ms'; 2.5 -> '2.50 s'; None (unknown) -> '–'."""
    if s is None:
        return "–"
    return f"{s * 1000:.0f} ms" if abs(s) < 1 else f"{s:.2f} s"


def pool_summary(snap) -> str:
    """The status bar's line about a Snapshot: pages by state, chains, hits and prefill saved."""
    counts = np.bincount(snap.page_states.astype(np.int64), minlength=4) if len(snap.page_states) else \
        np.zeros(4, dtype=np.int64)
    text = (f"Pool {len(snap.page_states)} pages: {counts[PAGE_PRIVATE]} in use"
            f" · {counts[PAGE_SHARED]} shared"
            f" · {counts[PAGE_CACHED]} cached · {counts[PAGE_FREE]} free  │  {len(snap.chains)} chains")
    if snap.timeline:
        row = snap.timeline[-1]
        text += (f"  │  hits {row.hits}/{row.queries}  │  prefill saved {row.prefill_saved} tok "
                 f"({row.hit_rate:.0%})")
        if snap.seconds_saved:
            text += f" ≈ {snap.seconds_saved:.1f} s"
    return text
