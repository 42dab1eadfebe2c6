"""The scheduler's timeline (one row per step) and per-request records (docs/design.md §6)."""

from __future__ import annotations

from array import array
from dataclasses import asdict, dataclass, fields

import numpy as np

from .kv_pool import KVPool
from .prefix_cache import PrefixCache
from .token_parts import Account, Eviction, TokenParts

# Page states, as the page map colours them.
PAGE_FREE, PAGE_PRIVATE, PAGE_SHARED, PAGE_CACHED = 0, 1, 2, 3
PAGE_STATE_NAMES = {PAGE_FREE: "free", PAGE_PRIVATE: "private", PAGE_SHARED: "shared",
                    PAGE_CACHED: "cached"}


def page_states(pool: KVPool, cache: PrefixCache | None) -> np.ndarray:
    """State of every pool page: free, private to sessions, shared, or held only by the cache."""
    states = np.where(pool.refcount > 0, PAGE_PRIVATE, PAGE_FREE).astype(np.int8)
    if cache is not None and cache.by_page:
        held = np.fromiter(cache.by_page, dtype=np.int64, count=len(cache.by_page))
        states[held] = np.where(pool.refcount[held] > 1, PAGE_SHARED, PAGE_CACHED)
    return states



def hit_rate(saved: int, computed: int) -> float:
    """The one hit rate (docs/design.md §6): saved / (saved + computed), the share of prompt tokens spared."""
    total = saved + computed
    return saved / total if total else 0.0

@dataclass
class TimelineRow:
    """Every metric of one scheduler step; cumulative counts since the scheduler started."""

    step: int
    wall_s: float
    capacity: int
    pages_private: int
    pages_shared: int
    pages_cached: int
    pages_free: int
    chains: int
    cached_pages: int
    queries: int
    hits: int
    hit_pages: int
    prefill_computed: int
    prefill_saved: int
    decode_tokens: int
    active: int
    queued: int
    batch_size: int
    step_s: float
    disk_hits: int = 0     # of `hits`, attaches that loaded pages back from the disk tier

    @property
    def hit_rate(self) -> float:
        """saved / (saved + computed) so far (`hit_rate`)."""
        return hit_rate(self.prefill_saved, self.prefill_computed)

    def to_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}

    @classmethod
    def columns(cls) -> list[str]:
        return [f.name for f in fields(cls)] + ["hit_rate"]


@dataclass
class RequestRecord:
    """What one request did: the numbers a user sees in its badges and the report."""

    id: int
    preview: str
    conversation_id: str | None
    namespace: str
    n_prompt: int
    n_cached: int = 0
    n_prefilled: int = 0
    n_gen: int = 0
    queue_wait_s: float = 0.0          # arrival to admission
    ttft_s: float | None = None         # arrival to the first token (vLLM's, SGLang's, llama.cpp's TTFT)
    decode_tps: float | None = None
    finish_reason: str | None = None
    chain_hit: int | None = None
    chain_donated: int | None = None
    text: str = ""
    submitted_s: float = 0.0           # arrival, seconds after the scheduler started
    finished_s: float | None = None
    client: str = ""                    # where the request came from, e.g. "http 127.0.0.1 user=bob"
    spec_drafted: int = 0               # speculative draft tokens verified for this request
    spec_accepted: int = 0              # of those, the ones its sampler agreed with
    spec_acceptance: float | None = None  # accepted / drafted (None while nothing was drafted)
    # Where its prompt tokens went (docs/design.md §15), set at admission by the attach itself:
    # the operator's view (every namespace), and `tenant`, what its own tenant may be told.
    parts: TokenParts | None = None
    diverged_at: int | None = None
    diverged_from: int | None = None
    diverged_words: str = ""            # the prompt's text from diverged_at on, a few tokens
    evicted_by: Eviction | None = None
    tenant: Account | None = None

    def take_account(self, account: Account, tenant: Account) -> None:
        """Keep the attach's accounting (the operator's view and the tenant's own)."""
        self.parts, self.diverged_at, self.diverged_from = (account.parts, account.diverged_at,
                                                            account.diverged_from)
        self.evicted_by, self.tenant = account.evicted_by, tenant

    def count_drafts(self, drafted: int, accepted: int) -> None:
        """Add one verification's drafted and accepted tokens."""
        self.spec_drafted += drafted
        self.spec_accepted += accepted
        self.spec_acceptance = self.spec_accepted / self.spec_drafted if self.spec_drafted else None

    def to_dict(self) -> dict:
        return asdict(self)


def timeline_row(pool: KVPool, cache: PrefixCache, **step) -> TimelineRow:
    """A timeline row: the pool's page states and the cache's counters now, plus the step's own
    figures (step, wall_s, prefill_computed, prefill_saved, decode_tokens, active, queued,
    batch_size, step_s)."""
    counts = np.bincount(page_states(pool, cache), minlength=4)
    c = cache.counters
    return TimelineRow(
        capacity=pool.capacity, pages_private=int(counts[PAGE_PRIVATE]),
        pages_shared=int(counts[PAGE_SHARED]), pages_cached=int(counts[PAGE_CACHED]),
        pages_free=int(counts[PAGE_FREE]), chains=len(cache.chains), cached_pages=len(cache.pages),
        queries=c.queries, hits=c.hits, hit_pages=c.hit_pages, disk_hits=c.disk_hits, **step)


# Timeline rows a scheduler keeps: the last this many steps (older rows go; the running totals
# are in each row). A long-running server must not grow without end: a row is about 1 KB, so
# this is about 10 MB, some minutes of a busy server's steps.
TIMELINE_ROWS = 10_000


class Timeline:
    """The last `keep` rows appended by the scheduler (a ring: at least `keep`, at most
    `keep + keep // 16` are held; 0: none, and the scheduler then builds none); readers take
    `rows` (a list, oldest first) or column arrays. Rows carry their step number: a reader that
    follows the timeline goes by it, not by position."""

    def __init__(self, keep: int = TIMELINE_ROWS):
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
            raise ValueError(f"a timeline keeps an integer >= 0 of rows, got {keep!r}")
        self.keep = keep
        self.rows: list[TimelineRow] = []

    def append(self, row: TimelineRow) -> None:
        self.rows.append(row)
        if len(self.rows) > self.keep + self.keep // 16:  # trim in batches: O(1) a row on average
            del self.rows[:len(self.rows) - self.keep]

    def column(self, name: str) -> np.ndarray:
        return np.array([getattr(r, name) for r in self.rows], dtype=np.float64)

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class RequestTokens:
    """What a request brought and gave back, for traces (app/replay): its prompt, the tokens
    its session handed the cache when it ended (None: it never ran), and when (seconds after
    the scheduler started). Arrays of int32: 4 bytes a token, kept for every request."""

    prompt: array
    donated: array | None
    admitted_s: float | None
    donated_s: float | None
