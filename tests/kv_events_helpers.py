"""Cache events shaped like engine.prefix_records' (kind, pages), for feeding a publisher by hand."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Page:
    """A cached page as a cache listener sees it."""

    key: int
    parent: int | None
    tokens: tuple
    namespace: str = ""


@dataclass(frozen=True)
class Event:
    """A cache change: "stored", "removed" or "cleared"."""

    kind: str
    pages: tuple = ()
    medium: str = "GPU"
