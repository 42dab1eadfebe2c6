"""The What-if tab's predicted latency, without Qt: the twin (docs/design.md §16) at the
capacities the tab sweeps.

One twin run per page size and finite or infinite capacity (the prefix cache's page budget,
`cache_pages`; the pool grows, as serve's), with the engine's own eviction policy: the twin is
the engine's scheduler, and the engine runs leaf-LRU only, so the other policies' curves have no
engine to predict. Two-tier rows are not predicted: the step cost has no term for a disk read.
The controller runs `run` off the UI thread; `cancelled` stops it between two requests.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import replace

from engine.eviction import DEFAULT_POLICY
from engine.stream import SchedulerSettings

from .stepcost import StepCost
from .trace import TraceSource
from .twin_replay import TwinConfig, predict
from .whatif import Knobs

TWIN_POLICY = DEFAULT_POLICY


class Cancelled(Exception):
    """The user stopped the prediction."""


def kept_cost(model_path: str | None) -> tuple[StepCost | None, str]:
    """The step cost `prefixlab calibrate` kept for the model, and where it is; None and a note
    saying how to get one when there is none."""
    from .calibrate import cost_path
    if not model_path:
        return None, ("None: load a model that was calibrated (`prefixlab calibrate --model FILE`), "
                      "or load a cost file")
    path = cost_path(model_path)
    if not os.path.exists(path):
        return None, (f"None kept for {os.path.basename(model_path)} on this machine: run "
                      f"`prefixlab calibrate --model {model_path}`, or load a cost file")
    return StepCost.load(path), path


def cost_text(cost: StepCost, where: str) -> str:
    """What the tab says about the cost it predicts with (beside the words "Step cost")."""
    return f"{where} (measured on {cost.machine or 'an unnamed machine'})"


def configurations(knobs: Knobs, trace_page_rows: int, hashed: bool) -> list[tuple[int, int | None]]:
    """(page size, capacity) per twin run: the sweep's page sizes (blank: the trace's own; hash-id
    traces: their block) by its capacities, in the sweep's order."""
    sizes = [trace_page_rows] if hashed else [p or trace_page_rows for p in knobs.page_rows]
    return [(rows, budget) for rows in dict.fromkeys(sizes) for budget in knobs.budgets]


def twin_config(cost: StepCost, page_rows: int, budget: int | None, slo_ttft_s: float | None = None,
                settings: SchedulerSettings | None = None) -> TwinConfig:
    """The twin of one configuration: the cache's budget in pages (None: unbounded)."""
    base = settings or SchedulerSettings()
    settings = replace(base, page_rows=page_rows, cache_pages=budget or 0)
    return TwinConfig(cost, settings, slo_ttft_s=slo_ttft_s)


def parse_slo(text: str) -> float | None:
    """The tab's TTFT SLO field: blank (none) or seconds > 0."""
    if not text.strip():
        return None
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 < v < float("inf"):
        raise ValueError(f"the TTFT SLO is a number of seconds > 0 (or blank), got {text.strip()!r}")
    return v


def run(source: TraceSource, configs: list[tuple[int, int | None]], cost: StepCost, requests: int,
        slo_ttft_s: float | None = None, progress: Callable[[int, int], None] | None = None,
        cancelled: Callable[[], bool] | None = None) -> list[dict]:
    """Each configuration through the twin, as rows: page_rows, budget, policy, the twin's figures
    (`TwinResult.to_json()`: ttft_s p50/p90/p99/mean, goodput_rps under the SLO, ...).
    `progress(done, total)` counts requests over all runs; `cancelled()` true raises Cancelled."""
    total = max(1, requests * len(configs))
    every = max(1, total // 200)  # a few hundred progress calls in all, not one per request
    rows = []
    for k, (page_rows, budget) in enumerate(configs):
        watched = _Watched(source, k * requests, total, every, progress, cancelled)
        res = predict(watched, twin_config(cost, page_rows, budget, slo_ttft_s))
        rows.append({"page_rows": page_rows, "budget": budget, "policy": TWIN_POLICY, **res.to_json()})
    if progress is not None:
        progress(total, total)
    return rows


class _Watched:
    """The trace as the twin reads it, with a progress call and a cancel check between requests."""

    def __init__(self, source: TraceSource, start: int, total: int, every: int, progress, cancelled):
        self.source, self.start, self.total, self.every = source, start, total, every
        self.progress, self.cancelled = progress, cancelled
        self.hashed, self.block_size = source.hashed, source.block_size

    def __iter__(self) -> Iterator:
        for i, r in enumerate(self.source):
            if self.cancelled is not None and self.cancelled():
                raise Cancelled("stopped")
            done = self.start + i
            if self.progress is not None and done % self.every == 0:
                self.progress(done, self.total)
            yield r
