"""The desktop's "Keep the cache across restarts" (docs/design.md §12): where the file lives,
and one status line per load or save. The file format, its checks and the atomic write are
app/cache_persist.py's PersistedCache; this only picks the folder and catches what it says.
"""

from __future__ import annotations

import os
import re

from ..cache_persist import PersistedCache


def cache_dir(root: str, scheduler) -> str:
    """The folder of one model, page size and dtype under `root`: a change of any of them
    finds its own file instead of refusing (and moving aside) another's."""
    stem = os.path.splitext(os.path.basename(scheduler.model.path))[0]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", stem)[:80] or "model"
    pool = scheduler.pool
    return os.path.join(root, f"{stem}-{pool.page_rows}rows-{pool.kv_dtype}")


class _Lines:
    """A file-like `out` for PersistedCache that keeps its last line."""

    def __init__(self):
        self.last = ""

    def write(self, text: str) -> None:
        if text.strip():
            self.last = text.strip()

    def flush(self) -> None:
        pass


class CacheKeeper:
    """Loads a scheduler's cache from, and saves it to, its folder under `root`."""

    def __init__(self, root: str = ""):
        self.root = root

    def _persisted(self, scheduler) -> tuple[PersistedCache, _Lines]:
        out = _Lines()
        return PersistedCache(cache_dir(self.root, scheduler), scheduler, out=out), out

    def load(self, scheduler) -> str:
        """Load the matching file into a new scheduler's empty cache; the line to show ("" when
        there is no file). A damaged file is moved aside by PersistedCache: one line, a cold cache."""
        if not self.root:
            return ""
        try:
            persisted, out = self._persisted(scheduler)
            persisted.load()
        except Exception as e:  # noqa: BLE001 - never a crash at start: a cold cache and one line
            scheduler.cache.release(scheduler.pool)
            return f"Cache not loaded: {type(e).__name__}: {e}"
        return out.last.replace("prefixlab: cache", "Cache", 1)

    def save(self, scheduler) -> str:
        """Write the scheduler's cache atomically; the line to show."""
        if not self.root:
            return "Cache not saved: no folder to keep it in"
        try:
            persisted, out = self._persisted(scheduler)
            persisted.save()
        except Exception as e:  # noqa: BLE001 - a full disk must not stop the quit
            return f"Cache not saved: {type(e).__name__}: {e}"
        return out.last.replace("prefixlab: cache", "Cache", 1)
