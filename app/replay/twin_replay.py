"""`prefixlab replay TRACE --twin`: a trace through one twin or N twins behind a router
(docs/design.md §16, §13's routers), streamed: each request is read, routed and submitted at its
arrival, and forgotten once it ends but for its figures (eight bytes each per measure), so a
million-request trace runs in bounded memory.
"""

from __future__ import annotations

import gc
import json
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from engine.stream import SchedulerSettings

from .routers import CACHE_ROUTERS, RouterKnobs, View, make_router
from .stepcost import StepCost
from .trace import TraceSource
from .twin import TWIN_VOCAB, Predicted, Twin, prompt_of

PROGRESS_EVERY = 1000   # requests between progress calls
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class TwinConfig:
    """One twin run: the cost, the scheduler's knobs, the replicas and their router, the SLOs."""

    cost: StepCost
    settings: SchedulerSettings = field(default_factory=SchedulerSettings)
    replicas: int = 1
    router: str = "round-robin"
    knobs: RouterKnobs = RouterKnobs()
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    context_length: int = TWIN_VOCAB
    speed: float = 1.0        # arrivals at the trace's times divided by this
    seed: int = 0             # of the draws from the cost's spread (stepcost.PassTimes)


@dataclass
class TwinResult:
    """Predicted figures over the whole trace."""

    requests: int = 0
    replicas: int = 1
    router: str = ""
    span_s: float = 0.0          # first arrival to last end
    queue_s: dict = field(default_factory=dict)      # p50 / p90 / p99
    ttft_s: dict = field(default_factory=dict)
    tpot_s: dict = field(default_factory=dict)
    latency_s: dict = field(default_factory=dict)    # arrival to the last token
    token_hit_ratio: float = 0.0
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    good: float = 0              # requests within both SLOs (the ones given); a mean over draws
    goodput_rps: float = 0.0     # good requests per second of the span
    steps: int = 0
    seconds: float = 0.0         # wall time of the prediction
    draws: int = 1               # runs of the trace (seeds) the figures are the mean of

    def to_json(self) -> dict:
        return dict(self.__dict__)


class _Books:
    """Per-request figures as flat arrays (8 bytes each), the running totals, the SLO count."""

    def __init__(self, config: TwinConfig, per_request: Callable[[Predicted], None] | None):
        self.cols = {name: array("d") for name in ("queue", "ttft", "tpot", "latency")}
        self.config, self.per_request = config, per_request
        self.good = self.input_tokens = self.cached = 0
        self.first_arrival, self.last_end = float("inf"), 0.0

    def done(self, p: Predicted) -> None:
        c = self.cols
        c["queue"].append(p.queue_s)
        c["ttft"].append(p.ttft_s)
        c["tpot"].append(p.tpot_s)
        c["latency"].append(p.end_s - p.arrival_s)
        self.input_tokens += p.input_length
        self.cached += p.cached_tokens
        self.first_arrival = min(self.first_arrival, p.arrival_s)
        self.last_end = max(self.last_end, p.end_s)
        cfg = self.config
        if (cfg.slo_ttft_s is None or p.ttft_s <= cfg.slo_ttft_s) and \
                (cfg.slo_tpot_s is None or p.tpot_s <= cfg.slo_tpot_s):
            self.good += 1
        if self.per_request is not None:
            self.per_request(p)


def predict(source: TraceSource, config: TwinConfig, progress=None,
            per_request: Callable[[Predicted], None] | None = None) -> TwinResult:
    """Run the trace through the twins; `progress(requests read)` every PROGRESS_EVERY requests,
    `per_request(Predicted)` as each request ends."""
    t0 = time.perf_counter()
    books = _Books(config, per_request)
    settings = _unbounded_queue(config.settings)
    reps = [Twin(config.cost, settings, config.context_length, on_done=books.done, seed=f"{config.seed}/{k}")
            for k in range(config.replicas)]
    route = make_router(config.router, config.replicas, config.knobs)
    block = source.block_size if source.hashed else None
    clock = 0.0
    was_enabled = gc.isenabled()
    gc.disable()  # the pages and records hold no cycles; collections would walk them all
    try:
        for i, r in enumerate(source):
            clock = max(clock, r.arrival_s / config.speed)  # a trace slightly out of order never runs back
            for rep in reps:
                rep.advance(clock)
            prompt = prompt_of(r, block)
            cached = [rep.cached_pages(prompt, r.namespace) for rep in reps]
            view = View(index=i, first_key=_first_key(reps[0], r, prompt),
                        blocks=-(-len(prompt) // settings.page_rows), tokens=len(prompt),
                        cached=cached if config.router in CACHE_ROUTERS else [],
                        load=[rep.load for rep in reps], decoding=[rep.kv_blocks for rep in reps])
            k = route(view)
            p = Predicted(i, clock, len(prompt), max(1, r.output_length), replica=k)
            reps[k].submit(p, prompt, r.namespace, cached[k] * settings.page_rows)
            if progress is not None and (i + 1) % PROGRESS_EVERY == 0:
                progress(i + 1)
        for rep in reps:
            rep.drain()
    finally:
        if was_enabled:
            gc.enable()
    return _result(config, books, sum(rep.steps for rep in reps), time.perf_counter() - t0)


def predict_draws(source: TraceSource, config: TwinConfig, draws: int, progress=None,
                  per_request: Callable[[Predicted], None] | None = None,
                  keep: bool = False) -> tuple[TwinResult, list[dict]]:
    """The trace through the twins `draws` times, seeds config.seed, +1, ...: a cost with a spread
    draws each pass's time, so one run's percentiles are one draw of what the server may do, and
    their mean over draws is the prediction. Returns that mean and, with `keep`, each draw's
    requests (index -> Predicted; without it, none are held: a long trace stays in bounded
    memory); `per_request` and `progress` follow the first draw."""
    from dataclasses import replace
    if not isinstance(draws, int) or draws < 1:
        raise ValueError(f"draws must be an integer >= 1, got {draws!r}")
    results, runs = [], []
    for k in range(draws):
        got: dict = {}
        if keep:
            runs.append(got)

        def done(p: Predicted, got=got, first=k == 0) -> None:
            if keep:
                got[p.index] = p
            if first and per_request is not None:
                per_request(p)
        results.append(predict(source, replace(config, seed=config.seed + k),
                               progress if k == 0 else None, done))
    return (results[0] if draws == 1 else mean_result(results)), runs


def mean_result(results: list[TwinResult]) -> TwinResult:
    """Each figure's mean over runs of one trace (steps and seconds: their sums)."""
    first = results[0]
    out = TwinResult(requests=first.requests, replicas=first.replicas, router=first.router,
                     slo_ttft_s=first.slo_ttft_s, slo_tpot_s=first.slo_tpot_s, draws=len(results),
                     steps=sum(r.steps for r in results), seconds=sum(r.seconds for r in results))
    for name in ("queue_s", "ttft_s", "tpot_s", "latency_s"):
        setattr(out, name, {q: float(np.mean([getattr(r, name)[q] for r in results]))
                            for q in getattr(first, name)})
    for name in ("span_s", "token_hit_ratio", "good", "goodput_rps"):
        setattr(out, name, float(np.mean([getattr(r, name) for r in results])))
    return out


def _unbounded_queue(settings: SchedulerSettings) -> SchedulerSettings:
    """The twin queues every arrival: a trace is what arrived, not what a full queue let in."""
    from dataclasses import replace
    return replace(settings, max_queue=2**31 - 1)


def _first_key(rep: Twin, r, prompt: list[int]) -> int:
    """prefix-hash's key: the first hash id, or the first page's chained key (token traces)."""
    if r.hash_ids:
        return r.hash_ids[0]
    rows = rep.settings.page_rows
    return rep.scheduler.cache.page_key(None, prompt[:rows], r.namespace)


def _result(config: TwinConfig, books: _Books, steps: int, seconds: float) -> TwinResult:
    res = TwinResult(replicas=config.replicas, router=config.router, slo_ttft_s=config.slo_ttft_s,
                     slo_tpot_s=config.slo_tpot_s, steps=steps, seconds=seconds)
    res.requests = len(books.cols["ttft"])
    if not res.requests:
        return res
    for name, col in books.cols.items():
        a = np.frombuffer(col, dtype=np.float64)
        values = np.percentile(a, PERCENTILES)
        setattr(res, f"{name}_s", {**{f"p{q}": float(v) for q, v in zip(PERCENTILES, values)},
                                   "mean": float(a.mean())})
    res.span_s = books.last_end - books.first_arrival
    res.token_hit_ratio = books.cached / books.input_tokens if books.input_tokens else 0.0
    res.good = books.good
    res.goodput_rps = books.good / res.span_s if res.span_s > 0 else 0.0
    return res


def summary(res: TwinResult) -> str:
    """The lines the CLI prints."""
    def ps(d: dict) -> str:
        return "  ".join(f"{k} {v:,.3f}" for k, v in d.items())
    slos = (("TTFT", res.slo_ttft_s), ("TPOT", res.slo_tpot_s))
    slo = " and ".join(f"{name} <= {v:g} s" for name, v in slos if v is not None)
    lines = [f"twin: {res.requests:,} requests on {res.replicas} replica(s)"
             + (f" behind {res.router}" if res.replicas > 1 else "")
             + f", {res.steps:,} passes predicted in {res.seconds:.1f} s"
             + (f" (the mean of {res.draws} draws of each pass's time)" if res.draws > 1 else ""),
             f"  queue s  {ps(res.queue_s)}", f"  TTFT s   {ps(res.ttft_s)}",
             f"  TPOT s   {ps(res.tpot_s)}", f"  total s  {ps(res.latency_s)}",
             f"  token hit ratio {res.token_hit_ratio:.4f}; span {res.span_s:,.1f} s"]
    if slo:
        good = f"{res.good:,}" if res.draws == 1 else f"{res.good:,.1f}"
        lines.append(f"  goodput under {slo}: {good} of {res.requests:,} requests "
                     f"({res.good / res.requests:.1%}), {res.goodput_rps:,.3f} req/s")
    return "\n".join(lines)


def write_per_request(path: str):
    """A per_request callback writing one JSON line per ended request to `path`; returns (fn, close)."""
    fh = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by the caller's close()
    return (lambda p: fh.write(json.dumps(p.to_json()) + "\n")), fh.close
