"""The engine's twin (docs/design.md §16): the engine's own `Scheduler` over pages that store
nothing, each pass timed by a step-cost model on a virtual clock.

Admission, chunked prefill, lending, continuous batching and eviction are the scheduler's own
code (the code `serve` runs); only the forward pass is replaced (`TwinRunner`, an
`engine.scheduler.Runner`): it records the pass's tokens in the pages, as `eval_batch` does,
and predicts the pass's seconds from its shape (app/replay/stepcost.py), plus an extra drawn
from the spread the calibration measured (seeded: a run repeats exactly; no spread, no draw).
Each request's answer is forced to the trace's output length (greedy over one-logit rows, no
stop tokens). A pass starts when the one before ends, or when a request arrives at an idle
replica; a request that arrives during a pass is admitted at the next pass, as in the engine.
A request is admitted at the start of the pass that admits it, and its first token and its end
come at the end of the pass that samples them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from engine.block_manager import BlockManager
from engine.loop import EngineLoop
from engine.metrics import Timeline
from engine.sampler import SamplingParams
from engine.scheduler import FinishEvent, SchedulerSettings, TokenEvent

from .stepcost import IDLE_GAP_S, PassShapes, PassTimes, StepCost
from .trace import TraceRequest

# A stand-in vocabulary as wide as token ids can be (the twin checks no id against a model).
TWIN_VOCAB = 2**31 - 1
# The token ids a hash-id trace's blocks are drawn from, for the twin and for `--against` alike:
# single ASCII characters in every byte-level vocabulary (GPT-2's, SmolLM's, Llama's byte
# tokens). Not the bytes above 0x7f: a prompt of incomplete UTF-8 gets an answer of it, whose
# tokens a server streams no text for, so the client's first piece came tokens after the first.
BLOCK_IDS = (32, 96)
KEPT_RECORDS = 64   # ended requests the twin's scheduler keeps (the twin keeps its own books)


@dataclass(frozen=True)
class StandInConfig:
    """The model facts the scheduler reads: its context length and vocabulary size."""

    context_length: int
    vocab_size: int = TWIN_VOCAB


class _Silent:
    """A token stream that shows no text (the twin's tokens are placeholders)."""

    def step(self, token_id: int) -> str:
        return ""


class _NoText:
    eos_ids: tuple[int, ...] = ()

    def decode(self, ids) -> str:
        return ""

    def stream(self) -> _Silent:
        return _Silent()


@dataclass
class TwinModel:
    """What the scheduler reads of a model, without weights."""

    config: StandInConfig
    tokenizer: _NoText


class Pages(BlockManager):
    """The twin's pool: the engine's page manager, no K/V arrays (`cfg` ties sessions to it)."""

    def __init__(self, cfg: StandInConfig, page_rows: int, max_pages: int | None):
        super().__init__(page_rows=page_rows, max_pages=max_pages)
        self.cfg = cfg


class TwinRunner:
    """A pass that records its tokens in storage-free pages and predicts its own duration: the
    cost's time for its shape, plus an extra drawn (seeded) from the cost's spread
    (stepcost.PassTimes)."""

    def __init__(self, cost: StepCost, cfg: StandInConfig, seed: int = 0):
        self.cost, self.cfg = cost, cfg
        self.shapes = PassShapes()
        self.times = PassTimes(cost, seed)
        self.last_s = 0.0   # the predicted seconds of the latest pass
        self.after_idle = True   # the replica had nothing to run before the next pass (Twin.step says)

    def new_pool(self, settings: SchedulerSettings) -> BlockManager:
        return Pages(self.cfg, settings.page_rows, settings.pool_pages)

    def forward(self, batch) -> np.ndarray:
        self.last_s = self.times(self.shapes(batch, self.after_idle))
        sessions, tokens = batch.sessions(), batch.tokens()
        pool = sessions[0].pool
        pool.allocate(sessions, [len(t) for t in tokens])
        pool.commit(sessions, tokens)
        rows = sum(batch.n_logits() or [1] * len(sessions))
        return np.zeros((rows, 1), dtype=np.float32)  # argmax is token 0: never a stop


@dataclass(slots=True)
class Predicted:
    """One request's predicted life on the twin (seconds on the trace's clock)."""

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    replica: int = 0
    admitted_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    cached_tokens: int = 0

    @property
    def queue_s(self) -> float:
        return self.admitted_s - self.arrival_s

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first (0 for a one-token answer)."""
        n = self.output_length
        return (self.end_s - self.first_token_s) / (n - 1) if n > 1 else 0.0

    def to_json(self) -> dict:
        return {"index": self.index, "replica": self.replica, "arrival_s": self.arrival_s,
                "input_length": self.input_length, "output_length": self.output_length,
                "cached_tokens": self.cached_tokens, "queue_s": self.queue_s, "ttft_s": self.ttft_s,
                "tpot_s": self.tpot_s, "end_s": self.end_s}


class Twin:
    """One replica: the engine's scheduler over storage-free pages, on a virtual clock."""

    def __init__(self, cost: StepCost, settings: SchedulerSettings | None = None,
                 context_length: int = TWIN_VOCAB, on_done=None, seed: int = 0):
        settings = settings or SchedulerSettings()
        self.cfg = StandInConfig(context_length)
        self.runner = TwinRunner(cost, self.cfg, seed)
        # The one loop every front end drives (docs/design.md §5), over the twin's runner.
        self.loop = EngineLoop(TwinModel(self.cfg, _NoText()), settings, runner=self.runner)
        self.scheduler = self.loop.scheduler
        self.scheduler.max_ended_records = KEPT_RECORDS
        self.scheduler.timeline = Timeline(keep=0)  # a million requests' passes: no row per pass
        self.now = 0.0
        self.last_end: float | None = None   # when the last pass ended
        self.on_done = on_done or (lambda p: None)   # called with each finished request's Predicted
        self._live: dict[int, tuple[Predicted, int, int]] = {}   # id -> (its books, work, KV pages)
        self._queued: dict[int, Predicted] = {}
        self.steps = 0
        self.load = 0        # outstanding tokens of work (uncached prompt + answer), routers read it
        self.kv_blocks = 0   # KV pages of the requests it holds (kv-cost reads it)
        self._events: list = []  # every job's events, one sink for all

    @property
    def settings(self) -> SchedulerSettings:
        return self.scheduler.settings

    def submit(self, p: Predicted, prompt: list[int], namespace: str = "", cached: int = 0) -> None:
        """Queue a request that arrives now (after `advance(p.arrival_s)`); `cached`: the prompt
        tokens its replica has cached now, for the load the routers see."""
        rid = self.loop.submit_now(self._events.append, arrival=p.arrival_s, prompt=prompt,
                                   sampling=SamplingParams(), max_new_tokens=max(1, p.output_length),
                                   stop_ids=[], preview=" ", namespace=namespace)
        work = p.input_length - cached + p.output_length
        blocks = -(-(p.input_length + p.output_length) // self.settings.page_rows)
        self._live[rid] = (p, work, blocks)
        self._queued[rid] = p
        self.load += work
        self.kv_blocks += blocks

    def advance(self, t: float) -> None:
        """Run passes that start before `t`; an idle replica's clock jumps to `t`."""
        while self.scheduler.has_work() and self.now < t:
            self.step()
        self.now = max(self.now, t)

    def drain(self) -> None:
        while self.scheduler.has_work():
            self.step()

    def step(self) -> None:
        start, sched = self.now, self.scheduler
        self.runner.last_s = 0.0
        self.runner.after_idle = self.last_end is None or start - self.last_end >= IDLE_GAP_S
        self._events.clear()
        self.loop.step()
        events = [ev for ev in self._events if isinstance(ev, (TokenEvent, FinishEvent))]
        if not self.runner.last_s and sched.has_work():
            raise RuntimeError("the twin's scheduler ran a pass with nothing in it while requests wait")
        self.now = start + self.runner.last_s
        if self.runner.last_s:
            self.last_end = self.now
        self.steps += 1
        if len(self._queued) > sched.queue_depth():  # some were admitted: find which (O(queue))
            waiting = {rid for rid, _, _ in sched.queued()}
            for rid in [rid for rid in self._queued if rid not in waiting]:
                self._queued.pop(rid).admitted_s = start
        for ev in events:
            if ev.request_id not in self._live:
                continue
            p, work, blocks = self._live[ev.request_id]
            if p.first_token_s is None:
                p.first_token_s = self.now
            if isinstance(ev, FinishEvent):
                p.end_s = self.now
                p.cached_tokens = ev.record.n_cached
                del self._live[ev.request_id]
                self.load -= work
                self.kv_blocks -= blocks
                self.on_done(p)

    def cached_pages(self, prompt: list[int], namespace: str = "") -> int:
        """Pages an attach would match now (read-only)."""
        return self.scheduler.cache.probe(prompt, namespace).matched_pages


# prompts -------------------------------------------------------------------------------
def prompt_of(r: TraceRequest, block_size: int | None, ids: tuple[int, int] = BLOCK_IDS) -> list[int]:
    """The request's prompt as token ids: its own, or (hash-id traces) one block of `block_size`
    tokens per hash id, the same id always the same block, the last block cut to the input length."""
    if r.prompt is not None:
        return r.prompt
    out: list[int] = []
    for h in r.hash_ids:
        out += block_tokens(h, block_size, *ids)
    return out[:r.input_length]


@functools.lru_cache(maxsize=4096)
def block_tokens(hash_id: int, block_size: int, low: int, high: int) -> tuple[int, ...]:
    """The block of a hash id: `block_size` token ids in [low, high), drawn from a generator
    seeded by the id (so every run, the twin and `--against` rebuild the same blocks)."""
    rng = np.random.default_rng(hash_id)
    return tuple(rng.integers(low, high, block_size).tolist())
