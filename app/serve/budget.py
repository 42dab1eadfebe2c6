"""The server's default KV memory budget: a share of this machine's RAM, as KV pool pages.

Without one, a long-running server keeps every prefix it ever saw and its pool only grows
(300 distinct chats took it from 0.7 to 1.9 GB). A cache budget alone was not enough: the
pool grows by doubling, so 1,000 chats under a 2.5 GB cache budget held a 3 GB pool. So the
budget bounds the pool itself: running requests and the cache share it, and the cache
gives pages back (least recently used first) when a request needs them. The desktop app
starts bounded by the same rule (app/desktop/settings.py).
"""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np

from engine.block_manager import pages_for
from engine.chat import CLOSING_SLACK
from engine.kv_pool import KV_DTYPES, kv_dtype_name

DEFAULT_KV_BUDGET = "10%"  # of physical RAM
_SIZE = re.compile(r"^\s*(?P<n>\d+(?:\.\d+)?)\s*(?P<unit>%|[kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def physical_ram() -> int:
    """This machine's RAM in bytes (0 when the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def parse_budget(text: str, ram: int | None = None) -> int:
    """Bytes of a budget such as "10%" (of RAM), "2GiB", "1.5G", "500MB" or "0" (no budget)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"--kv-budget: expected a size such as 10%, 2GiB or 500MB, got {text!r}")
    n, unit = float(m.group("n")), (m.group("unit") or "").lower()
    if unit == "%":
        if n > 100:
            raise ValueError(f"--kv-budget: {text!r} is more than all of the RAM")
        return int((physical_ram() if ram is None else ram) * n / 100)
    scale = _UNITS[unit[:1]] * ((1024 / 1000) ** "bkmgt".index(unit[:1]) if "i" in unit else 1)
    return int(n * scale)


def page_bytes(model, page_rows: int, itemsize: int = 4) -> int:
    """Bytes of one KV page: K and V of `page_rows` positions in every layer."""
    c = model.config
    return 2 * c.n_layers * page_rows * c.n_kv_heads * c.head_dim * itemsize


def budget_pages(budget_bytes: int, model, page_rows: int, itemsize: int = 4) -> int:
    """Cache pages that fit the budget (at least 1; 0 for no budget)."""
    return max(1, budget_bytes // page_bytes(model, page_rows, itemsize)) if budget_bytes > 0 else 0


def with_budget(settings, model, budget_bytes: int):
    """`settings` with a pool of the budget's pages, the cache within it, unless they set a pool
    or a cache budget themselves (or `budget_bytes` is 0). At least one full-context request
    fits. The app can start bounded the same way: with_budget(settings, model, parse_budget("10%"))."""
    if settings.cache_pages or settings.pool_pages or not budget_bytes:
        return settings
    one_request = pages_for(model.config.context_length + CLOSING_SLACK, settings.page_rows) + 1
    itemsize = np.dtype(KV_DTYPES[kv_dtype_name(settings.kv_dtype)]).itemsize  # float16: twice the pages
    pages = max(budget_pages(budget_bytes, model, settings.page_rows, itemsize), one_request)
    return dataclasses.replace(settings, pool_pages=pages, cache_pages=pages)


def budget_info(scheduler) -> dict:
    """The KV budget a scheduler runs under: the bounded pool's pages (else the cache's budget),
    and their bytes at its pool's dtype (0: none). /health and the app's window show it."""
    if scheduler is None:
        return {}
    s = scheduler.settings
    pages = s.pool_pages or (s.cache_pages if s.cache_enabled else 0)
    itemsize = scheduler.pool.k.dtype.itemsize if hasattr(scheduler.pool, "k") else 4
    one = page_bytes(scheduler.model, s.page_rows, itemsize)
    return {"kv_budget_bytes": pages * one, "kv_budget_pages": pages, "kv_page_bytes": one}


def share_words(spec: str) -> str:
    """Where a budget came from: "10% of RAM" for a share, else the option that set it."""
    return f"{spec} of RAM" if spec.strip().endswith("%") else "--kv-budget"


def headline(budget_bytes: int, pages: int, source: str) -> str:
    """"KV budget 2.35 GiB (10% of RAM): 3,190 pages" ("KV budget: none" without one)."""
    if not budget_bytes:
        return "KV budget: none"
    return f"KV budget {budget_bytes / 2**30:.2f} GiB ({source}): {pages:,} pages"


def describe(budget_bytes: int, pages: int, spec: str) -> str:
    """The startup line's words: size, where it came from, pages."""
    if not budget_bytes:
        return "KV budget: none (the prefix cache keeps every prefix; --kv-budget to bound it)"
    return (f"{headline(budget_bytes, pages, share_words(spec))} for running requests and the prefix "
            f"cache, which gives back its least recently used pages when full")
