"""The What-if tab's data, without Qt: which knobs to offer for a trace, and the rows of a sweep.

The app's controller calls `plan` when a trace is loaded (or the current session's is
taken), shows the knobs it suggests, and calls `run` (off the UI thread) with the
knobs the user picked; the widget (ui/whatif.py) draws the rows it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.eviction import POLICIES

from .record import save_session_trace
from .results import DEFAULT_POLICY, ReplayConfig, parse_budget
from .simulate import replay
from .sweep import Progress, configurations, run_sweep
from .trace import TraceError, TraceSource, open_trace

# Capacities offered by default: fractions of the pages the whole trace would keep cached.
FRACTIONS = (1 / 3, 1 / 10, 1 / 30, 1 / 100)
COMPARED_POLICIES = ("leaf-lru", "lru", "fifo")


@dataclass
class Knobs:
    """What to sweep: page sizes (token traces), budgets in pages (None: infinite), policies, and
    disk tiers under the budget (None: one tier; docs/design.md §12)."""

    page_rows: list[int | None] = field(default_factory=lambda: [None])
    budgets: list[int | None] = field(default_factory=lambda: [None])
    policies: list[str] = field(default_factory=lambda: [DEFAULT_POLICY])
    disk_budgets: list[int | None] = field(default_factory=lambda: [None])

    def validate(self) -> None:
        bad = [p for p in self.policies if p not in POLICIES]
        if bad or not self.policies:
            raise ValueError(f"policies must be some of {', '.join(POLICIES)}, got {self.policies!r}")
        if any(b is not None and (not isinstance(b, int) or b < 1) for b in self.budgets) or not self.budgets:
            raise ValueError(f"budgets must be integers >= 1 or None (infinite), got {self.budgets!r}")
        if any(p is not None and (not isinstance(p, int) or p < 1) for p in self.page_rows):
            raise ValueError(f"page sizes must be integers >= 1, got {self.page_rows!r}")
        if any(d is not None and (not isinstance(d, int) or d < 1) for d in self.disk_budgets) \
                or not self.disk_budgets:
            raise ValueError(f"disk tiers must be integers >= 1 (pages) or None, got {self.disk_budgets!r}")


def knobs_from_text(page_rows: str, budgets: str, policies: list[str], disk_budgets: str = "") -> Knobs:
    """The What-if fields as knobs: "16,32" (blank: the trace's own), "inf, 3000", policy names,
    and disk tiers "10000, 30000" (each a curve beside the one-tier curve, always drawn)."""
    try:
        rows = [int(w) for w in page_rows.replace(" ", "").split(",") if w] or [None]
    except ValueError:
        raise ValueError(f"page sizes are integers separated by commas, got {page_rows!r}") from None
    disks: list[int | None] = [None]
    for word in disk_budgets.split(","):
        if word.strip():
            disk = parse_budget(word)
            if disk is None:
                raise ValueError(f"a disk tier is an integer >= 1 (pages), got {word.strip()!r}")
            disks.append(disk)
    knobs = Knobs(rows, [parse_budget(w) for w in budgets.split(",") if w.strip()], list(policies),
                  sorted(set(disks), key=lambda d: d or 0))
    knobs.validate()
    return knobs


@dataclass
class Plan:
    """A loaded trace, what it holds, and the knobs suggested for it."""

    source: TraceSource
    requests: int
    page_rows: int          # the trace's own page size (hash-id traces: its block)
    cached_pages: int       # pages cached at the end with infinite capacity: the working set
    bound: float            # the token hit ratio at infinite capacity
    knobs: Knobs


def session_trace(sch, path: str, model_name: str = "") -> TraceSource:
    """The scheduler's session so far as a trace at `path` (the "This session" button)."""
    if not save_session_trace(path, sch, model_name, source="session"):
        raise TraceError("this session has no finished request yet: run some prompts first")
    return open_trace(path)


def plan(source: TraceSource) -> Plan:
    """Replay the trace once at infinite capacity and suggest capacities below its working set."""
    r = replay(source, ReplayConfig())
    pages = max(1, r.cached_pages)
    budgets = sorted({max(1, round(pages * f)) for f in FRACTIONS}, reverse=True)
    knobs = Knobs(budgets=[None, *budgets], policies=list(COMPARED_POLICIES))
    return Plan(source=source, requests=r.requests, page_rows=r.page_rows, cached_pages=r.cached_pages,
                bound=r.token_hit_ratio, knobs=knobs)


def run(source: TraceSource, knobs: Knobs, workers: int | None = None,
        progress: Progress | None = None) -> list[dict]:
    """Every configuration of the knobs, as rows (what `prefixlab replay --json` writes)."""
    knobs.validate()
    if source.hashed:
        knobs = Knobs([None], knobs.budgets, knobs.policies, knobs.disk_budgets)  # one page size: its block
    configs = configurations(knobs.page_rows, knobs.budgets, knobs.policies, knobs.disk_budgets)
    configs = [c for c in configs if c.budget is not None or not c.disk_budget]  # nothing to evict
    return [r.to_json() for r in run_sweep(source, configs, workers=workers, progress=progress or False)]
