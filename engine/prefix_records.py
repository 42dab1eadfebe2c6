"""The prefix cache's records: cached pages, chains, listener events, counters, probe results."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CachedPage:
    """One cached page: its pool page, tokens and place in the tree of prefixes."""

    key: int
    page: int
    tokens: tuple[int, ...]     # () for an id-keyed page: it stores no tokens
    parent: int | None
    namespace: str
    depth: int
    chain_id: int
    last_used: int = 0          # recency stamp of its last hit or insert
    uses: int = 0               # hits + inserts (LFU)
    born: int = 0               # insertion order (FIFO)
    children: set[int] = field(default_factory=set)
    free: int = 0               # its key in the default namespace (the ever-seen index's key)


@dataclass
class ChainRecord:
    """A chain: the pages one insert added. What `prefix_chain_list` reports."""

    id: int
    n_tokens: int
    pages_live: int
    hits: int
    preview: str
    created_at: float
    last_hit_at: float | None = None
    namespace: str = ""
    first_page_depth: int = 0
    pinned: bool = False          # never evicted; counts against the budget (`prefix_pin`)


@dataclass(frozen=True)
class CachedPageInfo:
    """A cached page as listeners see it: its key, its parent's key, its tokens, its namespace."""

    key: int
    parent: int | None
    tokens: tuple[int, ...]
    namespace: str


@dataclass(frozen=True)
class CacheEvent:
    """A change of the cache: "stored" (one insert's new pages, root to leaf), "removed"
    (one eviction batch) or "cleared" (`prefix_release`, no pages)."""

    kind: str
    pages: tuple[CachedPageInfo, ...] = ()
    medium: str = "GPU"         # the tier: "GPU" the pool's pages, "CPU" the disk tier's (vLLM's names)


@dataclass
class CacheCounters:
    """Cumulative counts since the cache was made: attaches, hits, pages in and out, tokens saved."""

    queries: int = 0
    hits: int = 0
    hit_pages: int = 0
    inserted_pages: int = 0
    evicted_pages: int = 0
    tokens_saved: int = 0
    demoted_pages: int = 0      # evicted pages moved to the disk tier
    disk_hit_pages: int = 0     # attached pages loaded back from the disk tier (also in hit_pages)
    disk_hits: int = 0          # attaches that loaded at least one page from the disk tier (also in hits)


@dataclass
class ProbeResult:
    """How far a prompt would match, and why it stops (see `prefix_probe`)."""

    matched_tokens: int
    matched_pages: int
    stop_reason: str          # "cap" | "miss" | "token_mismatch" | "end"
    first_diff_index: int | None
    nearest_chain_id: int | None
    cached_token: int | None = None  # what the nearest cached page holds at first_diff_index


class Inserted(int):
    """What `prefix_insert` returns: the pages it added (an int), `.left_out_for_pins`, the
    full pages it left out because caching them would have evicted a pinned page, and `.path`,
    the cached pages its tokens walked (the next insert of the session starts from them)."""

    left_out_for_pins: int
    path: list  # the cached pages the tokens walked, root first: `insert(known=...)` next time

    def __new__(cls, added: int, left_out_for_pins: int = 0, path: list | None = None):
        obj = super().__new__(cls, added)
        obj.left_out_for_pins = left_out_for_pins
        obj.path = path if path is not None else []
        return obj
