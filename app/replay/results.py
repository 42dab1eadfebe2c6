"""What a replay configuration is and what it measured (plain data, JSON-ready)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from engine.eviction import DEFAULT_POLICY
from engine.metrics import hit_rate
from engine.token_parts import zero_totals

OVER_TIME_POINTS = 64  # windows of the hit-ratio-over-time series, at most


@dataclass(frozen=True)
class ReplayConfig:
    """One point of a sweep: page size, cache budget in pages (None: infinite), eviction policy."""

    page_rows: int | None = None   # token traces; None: the trace's own (hash-id traces: its block)
    budget: int | None = None
    policy: str = DEFAULT_POLICY
    disk_budget: int | None = None  # a disk tier of this many pages under the budget (None: none)


class TokenHits:
    """A result's token hit ratio (tokens_saved / input_tokens), also in its JSON."""

    tokens_saved: int
    input_tokens: int
    skipped_lines: int   # bad trace lines left out (a lenient read)
    skipped: list        # the first few of them, {line, why}

    def note_skipped(self, source) -> None:
        """Record the bad lines `source`'s latest pass left out."""
        self.skipped_lines, self.skipped = source.skipped.count, list(source.skipped.examples)

    @property
    def token_hit_ratio(self) -> float:
        """The trace's hit rate, saved / (saved + computed), in replay's words (docs/design.md §10)."""
        return hit_rate(self.tokens_saved, self.input_tokens - self.tokens_saved)

    def to_json(self) -> dict:
        return {**asdict(self), "token_hit_ratio": self.token_hit_ratio}


@dataclass
class ReplayResult(TokenHits):
    """The hit figures of one configuration over a whole trace."""

    page_rows: int
    budget: int | None
    policy: str
    requests: int = 0
    hits: int = 0                  # requests that attached at least one cached page
    blocks_hit: int = 0            # pages attached from the cache
    tokens_saved: int = 0          # blocks_hit x page_rows: prefill tokens the cache spared
    input_tokens: int = 0
    evicted: int = 0
    cached_pages: int = 0          # pages cached at the end (infinite capacity: the working set)
    seconds: float = 0.0           # wall time of this replay
    over_time: list[dict] = field(default_factory=list)  # {t, requests, token_hit_ratio} per window
    disk_budget: int | None = None
    blocks_from_disk: int = 0      # of blocks_hit, those loaded back from the disk tier
    skipped_lines: int = 0
    skipped: list[dict] = field(default_factory=list)
    # where the trace's prompt tokens went (docs/design.md §15), and the ever-seen index's size
    parts: dict[str, int] = field(default_factory=zero_totals)
    seen_pages: int = 0


class OverTime:
    """Hit ratio per window of requests, in O(points) memory for a trace of any length.

    Windows start one request wide; when there are twice as many as wanted,
    neighbours merge and the width doubles, so the series always spans the
    whole trace in between `points` and 2 x `points` windows.
    """

    def __init__(self, points: int = OVER_TIME_POINTS):
        self.points = points
        self.width = 1
        self.windows: list[list] = []  # [t_end, requests, saved, total]

    def add(self, t: float, saved: int, total: int) -> None:
        w = self.windows
        if w and w[-1][1] < self.width:
            last = w[-1]
            last[0], last[1], last[2], last[3] = t, last[1] + 1, last[2] + saved, last[3] + total
            return
        w.append([t, 1, saved, total])
        if len(w) > 2 * self.points:
            self.windows = [_merge(w[i], w[i + 1]) if i + 1 < len(w) else w[i] for i in range(0, len(w), 2)]
            self.width *= 2

    def series(self) -> list[dict]:
        return [{"t": t, "requests": n, "token_hit_ratio": hit_rate(s, tot - s)}
                for t, n, s, tot in self.windows]


def _merge(a: list, b: list) -> list:
    return [b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3]]


def parse_budget(text: str) -> int | None:
    """A budget word: a positive integer of pages, or `inf` (None)."""
    word = text.strip().lower().replace("_", "").replace(",", "")
    if word == "inf":
        return None
    if not word.isdigit() or int(word) < 1:
        raise ValueError(f"a budget is an integer >= 1 (pages) or 'inf', got {text.strip()!r}")
    return int(word)
