"""Replay a trace over N replicas behind a router (docs/design.md §13).

Each replica is the single-cache replay's own page manager and prefix cache
(app.replay.simulate, pages without storage) at the configuration's budget and
policy. Requests go in arrival order; each one's lookup, insert and eviction
finish on its replica before that replica's next request looks up, so cache
contents never depend on the service model, and round-robin and prefix-hash hit
ratios are exact.

The service model only times things: a replica prefills one request at a time at
`prefill_rate` tokens/s (only its uncached tokens), then decodes it at
`decode_rate` tokens/s, with up to `slots` requests holding a slot (from the
start of their prefill to their last token). A request waits first-come
first-served for a slot and for the prefill; its TTFT is the end of its prefill
minus its arrival. Load (for least-loaded and cache-aware) is the outstanding
tokens of work (uncached prompt + answer) of the requests a replica holds that
have not finished by the arrival; kv-cost's "blocks being decoded" are the KV
blocks (prompt + answer) of those requests.
"""

from __future__ import annotations

import gc
import heapq
import time
from array import array
from dataclasses import asdict, dataclass, field

import numpy as np

from engine.token_parts import KEYS, TokenParts

from .results import DEFAULT_POLICY, ReplayConfig, TokenHits
from .routers import CACHE_ROUTERS, RouterKnobs, View, make_router
from .simulate import _Replay
from .trace import TraceRequest, TraceSource

# Each replica is a whole cache and each slot a heap entry: a cluster of a billion replicas is a
# typo, not a what-if (one request's routing looks at every replica)
MAX_REPLICAS = 1024
MAX_SLOTS = 4096


def replica_counts(text: str) -> list[int]:
    """Replica counts as typed, "1,2,4,8"; ValueError says what is wrong."""
    from ..common_args import parse_count
    counts = [parse_count(w) for w in text.replace(" ", "").split(",") if w]
    if None in counts:
        raise ValueError(f"replica counts are integers separated by commas, got {text!r}")
    if not counts or any(n < 1 for n in counts):
        raise ValueError(f"a cluster needs at least 1 replica, got {text!r}")
    if max(counts) > MAX_REPLICAS:
        raise ValueError(f"a cluster has at most {MAX_REPLICAS:,} replicas here, got {text!r}")
    return counts

# A cluster's parts: the engine's, and `routed` (held by another replica) before `new`
CLUSTER_PARTS = (*KEYS[:-1], "routed", KEYS[-1])


@dataclass(frozen=True)
class ServiceModel:
    """How fast one replica serves: prefill and per-request decode tokens/s, and concurrent slots."""

    prefill_rate: float
    decode_rate: float
    slots: int

    def validate(self) -> None:
        for name in ("prefill_rate", "decode_rate"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0 or v == float("inf"):
                raise ValueError(f"--{name.replace('_', '-')} must be a number of tokens/s > 0, got {v!r}")
        if not isinstance(self.slots, int) or not 1 <= self.slots <= MAX_SLOTS:
            raise ValueError(f"--slots must be an integer from 1 to {MAX_SLOTS}, got {self.slots!r}")


@dataclass(frozen=True)
class ClusterConfig:
    """One point of a cluster sweep."""

    replicas: int
    router: str
    service: ServiceModel
    budget: int | None = None
    policy: str = DEFAULT_POLICY
    page_rows: int | None = None
    knobs: RouterKnobs = RouterKnobs()


@dataclass
class ClusterResult(TokenHits):
    """What one (replicas, router, budget, policy) measured over the whole trace."""

    replicas: int
    router: str
    budget: int | None
    policy: str
    page_rows: int
    requests: int = 0
    input_tokens: int = 0
    tokens_saved: int = 0
    load_imbalance: float = 0.0      # max / mean tokens of work per replica
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    ttft_mean_s: float = 0.0
    per_replica: list[dict] = field(default_factory=list)  # requests, input/saved tokens, hit ratio, work
    # where the prompt tokens went (docs/design.md §15) on the replica each request was routed to,
    # with `routed`: tokens another replica held beyond what that replica held (the router's regret)
    parts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLUSTER_PARTS, 0))
    service: dict = field(default_factory=dict)
    seconds: float = 0.0
    skipped_lines: int = 0
    skipped: list[dict] = field(default_factory=list)


class _Replica:
    """One replica: its cache (a single-cache replay), its slots, its prefill queue, its load."""

    def __init__(self, config: ClusterConfig, rows: int, hashed: bool):
        cache = ReplayConfig(config.page_rows, config.budget, config.policy)
        self.sim = _Replay(cache, rows=rows, hashed=hashed)
        self.slots = [0.0] * config.service.slots       # when each slot is free (a heap)
        self.prefill_free = 0.0
        self.running: list[tuple[float, int, int]] = []  # (finish, work tokens, kv blocks) heap
        self.load, self.decoding = 0, 0
        self.requests = self.input_tokens = self.saved = self.work = 0

    def settle(self, t: float) -> None:
        """Forget the requests that finished by `t`."""
        run = self.running
        while run and run[0][0] <= t:
            _, work, blocks = heapq.heappop(run)
            self.load -= work
            self.decoding -= blocks

    def cached_blocks(self, r: TraceRequest) -> int:
        """Blocks a lookup would attach now (read-only: touches nothing)."""
        sim = self.sim
        prompt = r.hash_ids if sim.hashed else r.prompt
        n = 0
        for _, _, _, ok in sim.cache.walk(prompt, r.namespace, (r.input_length - 1) // sim.rows):
            if not ok:
                break
            n += 1
        return n

    def serve(self, r: TraceRequest, t: float, service: ServiceModel) -> float:
        """Run the request's cache calls, queue it; return its TTFT."""
        before = self.sim.result.tokens_saved
        self.sim.finish(self.sim.admit(r), r)  # lookup, insert, release (and eviction) now
        saved = self.sim.result.tokens_saved - before
        prefill = r.input_length - saved
        start = max(t, heapq.heappop(self.slots), self.prefill_free)
        first = start + prefill / service.prefill_rate
        self.prefill_free = first
        end = first + r.output_length / service.decode_rate
        heapq.heappush(self.slots, end)
        work, blocks = prefill + r.output_length, -(-(r.input_length + r.output_length) // self.sim.rows)
        heapq.heappush(self.running, (end, work, blocks))
        self.load += work
        self.decoding += blocks
        self.requests += 1
        self.input_tokens += r.input_length
        self.saved += saved
        self.work += work
        return first - t


PROGRESS_EVERY = 10_000  # requests between progress calls


def replay_cluster(source: TraceSource, config: ClusterConfig, progress=None) -> ClusterResult:
    """Run the whole trace over `config.replicas` replicas behind `config.router`;
    `progress(requests done)` is called every PROGRESS_EVERY requests."""
    t0 = time.perf_counter()
    config.service.validate()
    if not 1 <= config.replicas <= MAX_REPLICAS:
        raise ValueError(f"--replicas takes 1 to {MAX_REPLICAS} replicas, got {config.replicas:,}")
    rows, hashed = _page_rows(source, config.page_rows)
    reps = [_Replica(config, rows, hashed) for _ in range(config.replicas)]
    route = make_router(config.router, config.replicas, config.knobs)
    needs_cache = config.router in CACHE_ROUTERS
    ttft = array("d")  # 8 bytes a request: a million requests cost 8 MB
    parts = dict.fromkeys(CLUSTER_PARTS, 0)
    clock = 0.0
    was_enabled = gc.isenabled()
    gc.disable()  # as in simulate.replay: the cached pages hold no cycles
    try:
        for i, r in enumerate(source):
            clock = max(clock, r.arrival_s)  # a trace slightly out of order never runs time backwards
            for rep in reps:
                rep.settle(clock)
            cached = [rep.cached_blocks(r) for rep in reps]   # also what `routed` weighs
            view = View(index=i, first_key=_first_key(reps[0].sim, r), blocks=_blocks(r, rows),
                        tokens=r.input_length,
                        cached=cached if needs_cache else [],
                        load=[rep.load for rep in reps], decoding=[rep.decoding for rep in reps])
            chosen = route(view)
            ttft.append(reps[chosen].serve(r, clock, config.service))
            _count_parts(parts, reps[chosen].sim.last_parts, cached, chosen, rows, r.input_length)
            if progress is not None and (i + 1) % PROGRESS_EVERY == 0:
                progress(i + 1)
    finally:
        if was_enabled:
            gc.enable()
    res = _result(config, rows, reps, ttft, time.perf_counter() - t0)
    res.parts = parts
    res.note_skipped(source)
    return res


def _count_parts(totals: dict[str, int], parts: TokenParts, cached: list[int], chosen: int, rows: int,
                 n_tokens: int) -> None:
    """Add a request's parts on its replica to `totals`, the tokens another replica held past
    the chosen one's match carved out as `routed` (from the parts after `cached`, in prompt order)."""
    best = max((c for j, c in enumerate(cached) if j != chosen), default=0)
    routed = max(0, min(best * rows, n_tokens) - min(cached[chosen] * rows, n_tokens))
    d = parts.as_dict()
    for k in ("evicted", "isolated", "rounding", "new"):
        take = min(routed, d[k])
        d[k] -= take
        d["routed"] = d.get("routed", 0) + take
        routed -= take
    for k, v in d.items():
        totals[k] += v


def _page_rows(source: TraceSource, page_rows: int | None) -> tuple[int, bool]:
    if source.hashed:
        if page_rows not in (None, source.block_size):
            raise ValueError(f"a hash-id trace replays at its own block size ({source.block_size}); "
                             f"page size {page_rows} needs a token trace")
        return source.block_size, True
    rows = page_rows or source.header.page_rows
    if rows is None:
        raise ValueError(f"{source.path}: the trace has no page size of its own; give one")
    return rows, False


def _blocks(r: TraceRequest, rows: int) -> int:
    return -(-r.input_length // rows)


def _first_key(sim: _Replay, r: TraceRequest) -> int:
    """prefix-hash's key: the first hash id, or the first page's chained key (token traces)."""
    if sim.hashed:
        return r.hash_ids[0]
    return sim.cache.page_key(None, r.prompt[:sim.rows], r.namespace)


def _result(config: ClusterConfig, rows: int, reps: list[_Replica], ttft: array,
            seconds: float) -> ClusterResult:
    res = ClusterResult(replicas=config.replicas, router=config.router, budget=config.budget,
                        policy=config.policy, page_rows=rows, service=asdict(config.service), seconds=seconds)
    for rep in reps:
        res.requests += rep.requests
        res.input_tokens += rep.input_tokens
        res.tokens_saved += rep.saved
        res.per_replica.append({"requests": rep.requests, "input_tokens": rep.input_tokens,
                                "tokens_saved": rep.saved, "work_tokens": rep.work,
                                "token_hit_ratio": rep.saved / rep.input_tokens if rep.input_tokens else 0.0})
    works = [rep.work for rep in reps]
    mean = sum(works) / len(works)
    res.load_imbalance = max(works) / mean if mean else 1.0
    if len(ttft):
        a = np.frombuffer(ttft, dtype=np.float64)
        res.ttft_p50_s, res.ttft_p99_s = (float(x) for x in np.percentile(a, [50, 99]))
        res.ttft_mean_s = float(a.mean())
    return res
