"""Continuous batching over a paged KV pool with a prefix cache (docs/design.md §4), in nano-vllm's shape.

`step()` = `schedule()` -> ONE `eval_batch` -> `postprocess()`. `schedule` admits queued
requests (attaching their cached prefix, then taking every page the request may fill, so
the forward pass never allocates), and plans the pass: every decoding stream's next token,
one prefill chunk of at most `chunk_tokens` prompt tokens, and the closing tokens of turns
that finished in the step before. `postprocess` samples, publishes each full prompt page to
the cache as soon as it is computed, finishes streams, and donates and releases sessions.
Admission is prefix-aware: a request whose uncached prefix another stream is computing shares
those pages instead of computing them twice, joining the pass that writes them (or waiting).

The scheduler knows requests (token ids), not chat: conversations live in the chat front end
(engine/conversations.py), and every front end reaches the scheduler through the one owner
loop (engine/loop.py). What the app may read goes through named calls (`record`, `records`,
`queue_depth`, `prompt_of`, `ended_tokens`) and the read-only `pool`, `cache` and `timeline`.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from array import array
from collections import deque
from collections.abc import Iterator
from typing import Protocol

import numpy as np

from .admission import can_take, plan_prefill
from .api import create_kv_pool, create_prefix_cache, create_session, eval_batch
from .block_manager import BlockManager
from .lending import account_loan, can_lend, in_flight_share, lend, settle_borrowers
from .loader import Model
from .metrics import RequestRecord, RequestTokens, Timeline, page_states, timeline_row
from .sampler import Sampler, SamplingParams
from .spec import plan_drafts, verify
from .stream import (
    MAX_NEW_TOKENS,
    Batch,
    FinishEvent,
    QueueFull,
    Request,
    SchedulerSettings,
    Stream,
    SubmitRefused,
    TokenEvent,
    check_fits,
)
from .token_parts import Account, TokenParts

__all__ = ["MAX_NEW_TOKENS", "Batch", "FinishEvent", "QueueFull", "Request", "Scheduler",
           "SchedulerSettings", "Stream", "SubmitRefused", "TokenEvent"]

# Settings that need a new pool (the pages' shape or storage), hence a new Scheduler
POOL_FIELDS = ("page_rows", "pool_pages", "kv_dtype", "disk_tier_pages")
# Ended requests whose records (and prompt tokens, for traces) are kept; older ones go, their
# numbers stay in the running totals. A long-running server must not grow without end.
MAX_ENDED_RECORDS = 10_000


class Runner(Protocol):
    """What runs the scheduler's passes: a pool of pages for it to hold, and per planned `Batch`
    the logits after each row it samples from, the batch's tokens recorded in the pool. The twin
    (app/replay/twin.py, docs/design.md §16) runs one over pages that store nothing."""

    def new_pool(self, settings: SchedulerSettings) -> BlockManager: ...

    def forward(self, batch: Batch) -> np.ndarray: ...


class ModelRunner:
    """The model's forward pass over a KV pool: what `serve` runs."""

    def __init__(self, model: Model):
        self.model = model

    def new_pool(self, settings: SchedulerSettings) -> BlockManager:
        return create_kv_pool(self.model, settings.page_rows, settings.pool_pages, kv_dtype=settings.kv_dtype)

    def forward(self, batch: Batch) -> np.ndarray:
        return eval_batch(self.model, batch.sessions(), batch.tokens(), n_logits=batch.n_logits(),
                          prompt=batch.prompts())


class Scheduler:
    """Continuous batching with a prefix cache; drive it with `submit` and `step`."""

    def __init__(self, model: Model, settings: SchedulerSettings | None = None, runner: Runner | None = None):
        """`runner` runs each pass: the model's forward pass (`ModelRunner`) unless given."""
        self.settings = dataclasses.replace(settings) if settings else SchedulerSettings()
        self.settings.validate()
        self.model = model
        self.runner = runner or ModelRunner(model)
        self.pool = self.runner.new_pool(self.settings)
        self.cache = create_prefix_cache(max_pages=self.settings.cache_pages,
                                         disk_pages=self.settings.disk_tier_pages)
        self.cache.bind(self.pool)
        self._queue: deque[Stream] = deque()
        self._active: list[Stream] = []
        self._closing: list[Stream] = []       # finished turns whose closing tokens run next step
        self._records: dict[int, RequestRecord] = {}
        self._tokens: dict[int, RequestTokens] = {}  # ended requests' prompts and donations (traces)
        self._ended: deque[int] = deque()             # ended request ids, oldest first
        self.max_ended_records = MAX_ENDED_RECORDS    # the twin keeps fewer (app/replay/twin.py)
        self.timeline = Timeline()
        self.waiting_for_pages: int | None = None  # the queued request that waits for free pages
        self._cancel_asked = False  # a cancel since the last schedule: the queue is scanned for it
        self._ids = itertools.count(1)
        self._t0 = time.perf_counter()
        self._steps = 0
        self.prefill_computed = 0
        self.prefill_saved = 0
        self.prefill_seconds = 0.0
        self.decode_tokens = 0

    def update_settings(self, settings: SchedulerSettings) -> None:
        """Apply new knobs now; POOL_FIELDS need a new pool (a new Scheduler)."""
        settings.validate()
        for name in POOL_FIELDS:
            if getattr(settings, name) != getattr(self.settings, name):
                raise ValueError(f"changing {name} needs a new KV pool: create a new Scheduler")
        self.settings = dataclasses.replace(settings)
        self.cache.max_pages = settings.cache_pages
        self.cache.enforce_budget()

    # submit -----------------------------------------------------------
    def submit(self, request: Request) -> int:
        """Queue a request; return its id (SubmitRefused says why not)."""
        arrival = time.perf_counter() if request.arrival is None else float(request.arrival)
        self.check_room()
        max_new = request.max_new_tokens
        if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1:
            raise SubmitRefused(f"max_new_tokens must be an integer >= 1, got {max_new!r}")
        try:
            sampler = Sampler(request.sampling or SamplingParams())
        except ValueError as e:
            raise SubmitRefused(str(e)) from e
        tok = self.model.tokenizer
        prompt = [int(t) for t in request.prompt]
        positions = check_fits(prompt, max_new, self.model.config, self.pool)
        rid = next(self._ids)
        record = RequestRecord(id=rid, preview=request.preview or tok.decode(prompt[-24:]),
                               conversation_id=request.conversation_id, namespace=request.namespace,
                               n_prompt=len(prompt), submitted_s=arrival - self._t0, client=request.client)
        stop_ids = request.stop_ids
        stream = Stream(record=record, prompt=prompt, sampler=sampler, max_new_tokens=max_new,
                        stop_ids=frozenset(stop_ids if stop_ids is not None else tok.eos_ids),
                        text_stream=tok.stream(), arrival=arrival, positions=positions,
                        closing_turn=request.closing)
        self._records[rid] = record
        self._queue.append(stream)
        return rid

    # read calls -------------------------------------------------------
    def record(self, request_id: int) -> RequestRecord | None:
        """The live record of a request (None once it aged out of the ring)."""
        return self._records.get(request_id)

    def records(self) -> list[RequestRecord]:
        """Every kept request's record (live objects), in submit order."""
        return list(self._records.values())

    def queue_depth(self) -> int:
        """Requests waiting for admission."""
        return len(self._queue)

    def check_room(self) -> None:
        """Raise QueueFull when `max_queue` requests are waiting."""
        if len(self._queue) >= self.settings.max_queue:
            raise QueueFull(f"the queue is full: {self.settings.max_queue} requests are waiting; retry later")

    def prompt_of(self, request_id: int) -> list[int] | None:
        """The prompt tokens of a queued or running request."""
        s = self._find(request_id)
        return s.prompt if s is not None else None

    def queued(self) -> Iterator[tuple[int, list[int], str]]:
        """(id, prompt, namespace) of each queued request, in queue order."""
        return ((s.id, s.prompt, s.record.namespace) for s in self._queue)

    def ended_tokens(self) -> dict[int, RequestTokens]:
        """Ended requests' prompts and donated tokens (the kept ones), by id: traces read these."""
        return dict(self._tokens)

    def n_running(self) -> int:
        """Requests holding a session (running or closing their turn)."""
        return len(self._active) + len(self._closing)

    def _find(self, request_id: int) -> Stream | None:
        return next((s for s in itertools.chain(self._queue, self._active) if s.id == request_id), None)

    # control ----------------------------------------------------------
    def cancel(self, request_id: int, reason: str = "cancelled") -> bool:
        """Ask a queued or running request to stop; it finishes at the next step with `reason`
        ("stop" when the server found a stop string; the first reason asked for stays)."""
        s = self._find(request_id)
        if s is None or s.finish_reason is not None:
            return False
        s.cancel_requested = s.cancel_requested or reason
        self._cancel_asked = True
        return True

    def cancel_all(self) -> None:
        for s in itertools.chain(self._queue, self._active):
            s.cancel_requested = s.cancel_requested or "cancelled"
        self._cancel_asked = True

    def has_work(self, closing: bool = True) -> bool:
        return bool(self._queue or self._active or (closing and self._closing))

    def flush_cache(self) -> int:
        """Evict every cached page no session holds; return how many."""
        return self.cache.evict(len(self.cache.pages))

    def page_states(self) -> np.ndarray:
        return page_states(self.pool, self.cache)

    def streams(self) -> list[Stream]:
        """Every stream holding a session: running, then closing."""
        return self._active + self._closing

    # step -------------------------------------------------------------
    def step(self) -> list:
        """schedule -> one batched forward pass -> postprocess; return the events."""
        t0 = time.perf_counter()
        batch = self.schedule()
        logits = self.runner.forward(batch) if batch.sessions() else None
        events = self.postprocess(batch, logits)
        step_s = time.perf_counter() - t0
        if batch.n_prefill:
            self.prefill_seconds += step_s * batch.n_prefill / batch.size
        self._record(step_s, batch.size)
        return events

    def schedule(self) -> Batch:
        """Take cancelled requests out, admit queued ones, and plan this step's forward pass."""
        batch = Batch(closing=list(self._closing))
        if self._cancel_asked:  # a deep queue is not scanned every step, only after a cancel
            self._cancel_asked = False
            for s in [s for s in self._queue if s.cancel_requested]:
                self._queue.remove(s)
                batch.cancelled.append(s)
        for s in self._active:
            if s.cancel_requested and s.finish_reason is None:
                batch.cancelled.append(s)
        self._admit()
        leaving = {s.id for s in batch.cancelled}
        batch.decode = [s for s in self._active if s.decoding and s.id not in leaving]
        batch.prefill = plan_prefill(self._active, leaving, self.settings.chunk_tokens)
        if self.settings.spec_enabled:
            batch.drafts = plan_drafts(batch.decode, self.settings.spec_k, self.model.config.context_length)
        return batch

    def _words_at(self, prompt: list[int], at: int | None, n: int = 6) -> str:
        """The prompt's text from token `at` on (n tokens): where it departed, in words."""
        if at is None or at >= len(prompt):
            return ""
        return self.model.tokenizer.decode(prompt[at:at + n])

    def _admit(self) -> None:
        self.waiting_for_pages, rows = None, self.settings.page_rows
        if len(self._active) >= self.settings.max_streams:
            return  # before copying the queue: under load it is long and every stream is busy
        for s in list(self._queue):
            if len(self._active) >= self.settings.max_streams:
                return
            share = self.settings.cache_enabled and in_flight_share(s, self.streams(), self.cache, rows)
            if s.cancel_requested or (share and not can_lend(share, rows, self.settings.chunk_tokens)):
                continue
            need = s.pages_needed(rows)
            if not can_take(self.pool, self.cache, need):
                if not self.streams():
                    raise RuntimeError(f"request {s.id} needs {need} pages that an idle pool of "
                                       f"{self.pool.capacity} cannot give: a reservation bug")
                self.waiting_for_pages = s.id  # keep FIFO order under memory pressure
                return
            self._queue.remove(s)
            self.cache.actor = s.id   # the request its evictions name (docs/design.md §15)
            s.session = create_session(self.model, self.pool)
            s.admitted_at = time.perf_counter()
            s.record.queue_wait_s = s.admitted_at - s.arrival
            if share:  # joins the pass that writes the shared pages (engine/lending.py)
                lend(self.pool, share, s, rows)
                s.record.take_account(*account_loan(self.cache, s, share))
            elif self.settings.cache_enabled:
                matched, account, tenant = self.cache.attach_accounted(self.pool, s.session, s.prompt,
                                                                       s.record.namespace)
                if matched:
                    s.record.chain_hit = self.cache.chain_of(s.session.page_table[-1])
                s.record.n_cached = matched
                s.record.take_account(account, tenant)
                self.prefill_saved += matched
            else:
                cold = Account(TokenParts(new=len(s.prompt)))
                s.record.take_account(cold, cold)
            s.record.diverged_words = self._words_at(s.prompt, s.record.diverged_at)
            # A bounded pool takes every page the request may fill now, so it never runs dry
            # mid-answer; an unbounded one grows as the answer does (eval_batch allocates).
            bounded = self.pool.max_pages is not None
            self.pool.reserve(s.session, s.positions if bounded else len(s.prompt))
            self._active.append(s)

    def postprocess(self, batch: Batch, logits: np.ndarray | None) -> list:
        """Sample, publish computed prompt pages, finish streams, release closed turns; events."""
        events: list = []
        self.decode_tokens += len(batch.decode) + sum(map(len, batch.drafts))
        self.prefill_computed += batch.n_prefill
        row = 0
        for s, drafts in zip(batch.decode, batch.draft_lists()):
            events += self._sample_drafted(s, drafts, logits[row:row + 1 + len(drafts)])
            row += 1 + len(drafts)
        base = row
        for j, (s, piece) in enumerate(batch.prefill):
            s.record.n_prefilled += len(piece)
            if self.settings.cache_enabled:
                self._publish(s, s.prompt)  # as soon as computed, so concurrent prompts share
            if not s.prefilling:
                events += self._sample(s, logits[base + j])
        self.prefill_saved += settle_borrowers(self._active, self._queue, self.pool, self.cache)
        for s in batch.closing:
            self._closing.remove(s)
            self._donate_and_release(s)
        for s in batch.cancelled:
            s.finish_reason = s.cancel_requested
            if s in self._active:
                self._active.remove(s)
            events.append(self._finish(s))
        for s in [s for s in self._active if s.finish_reason is not None]:
            self._active.remove(s)
            events.append(self._finish(s))
        self.cache.actor = None
        return events

    def _publish(self, s: Stream, tokens: list[int]) -> None:
        """Offer the session's full pages of `tokens` to the cache, into this request's chain."""
        chain = s.record.chain_donated if s.record.chain_donated in self.cache.chains else None
        self.cache.actor = s.id
        s.published = self.cache.insert(self.pool, s.session, tokens, s.record.preview,
                                        s.record.namespace, chain_id=chain, known=s.published).path
        if s.record.chain_donated is None:
            s.record.chain_donated = self._own_chain(s)

    def _own_chain(self, s: Stream) -> int | None:
        """The chain holding this session's deepest page, if the session's own page was cached."""
        for page in reversed(self.pool.table(s.session)):
            chain = self.cache.chain_of(page)
            if chain is not None:
                return chain if chain != s.record.chain_hit else None
        return None

    def _sample_drafted(self, s: Stream, drafts: list[int], logits: np.ndarray) -> list[TokenEvent]:
        """Verify a decoding stream's drafts: keep what its sampler agrees with, roll back the rest.

        The pass evaluated the stream's last token and its drafts; the session keeps the last
        token plus each accepted draft that a kept token follows, and forgets the others.
        """
        if not drafts:
            return self._sample(s, logits[0])
        kept = verify(s.sampler, s.prompt + s.generated, drafts, logits)
        s.record.count_drafts(len(drafts), len(kept) - 1)
        self.pool.rollback(s.session, len(drafts))  # now it holds the last token only
        events: list[TokenEvent] = []
        now = time.perf_counter()
        for i, token in enumerate(kept):
            events += s.accept(token, now, self.model.config.context_length)
            if s.finish_reason is not None or i == len(kept) - 1:
                break
            self.pool.commit([s.session], [[token]])  # the pass already wrote this draft's K/V
        return events

    def _sample(self, s: Stream, logits: np.ndarray) -> list[TokenEvent]:
        token = s.sampler.sample(logits, s.recent(s.sampler.params.repeat_last_n))
        return s.accept(token, time.perf_counter(), self.model.config.context_length)

    # finish -----------------------------------------------------------
    def _finish(self, s: Stream) -> FinishEvent:
        """Close the record; a turn that ended by stop or length gets its closing tokens run in
        the next step before the session donates and releases (the front end says which)."""
        s.close_record(time.perf_counter(), self._t0)
        if s.closing_turn is not None and s.cancel_requested is None and s.session is not None:
            answer = s.generated[:-1] if s.finish_reason == "stop" else s.generated
            turn = s.closing_turn(answer)
            if self.settings.cache_enabled:
                s.closing = self._closing_tail(s, list(turn))
        if s.closing:
            self._closing.append(s)
        elif s.session is not None:
            self._donate_and_release(s)
        else:  # cancelled while queued: it never attached nor donated
            self._ended_request(s, None, None)
        return FinishEvent(s.id, s.finish_reason, s.record)

    def _closing_tail(self, s: Stream, turn: list[int]) -> list[int]:
        """The turn's tokens the session has not evaluated, as far as its reserved positions reach."""
        evaluated = self.pool.tokens(s.session)
        n = len(evaluated)
        if turn[:n] != evaluated:
            return []
        room = min(s.positions, self.model.config.context_length) - n
        return turn[n:n + max(0, room)]

    def _donate_and_release(self, s: Stream) -> None:
        """Publish what the session evaluated (a cancelled stream: what ran), then release it."""
        donated = self.pool.tokens(s.session)
        if self.settings.cache_enabled and s.loan is None:  # a borrower's unwritten pages are no prefix
            self._publish(s, donated)
        s.closing = []
        self.cache.actor = s.id   # a release may evict down to the budget
        self.pool.free_session(s.session)
        self._ended_request(s, array("i", donated), s.admitted_at - self._t0)

    def _ended_request(self, s: Stream, donated: array | None, admitted_s: float | None) -> None:
        """Keep the ended request's tokens for traces; past the ring's size the oldest go."""
        self._tokens[s.id] = RequestTokens(array("i", s.prompt), donated, admitted_s,
                                           time.perf_counter() - self._t0)
        self._ended.append(s.id)
        while len(self._ended) > self.max_ended_records:
            old = self._ended.popleft()
            self._records.pop(old, None)
            self._tokens.pop(old, None)

    # metrics ----------------------------------------------------------
    def _record(self, step_s: float, batch: int) -> None:
        self._steps += 1
        if not self.timeline.keep:  # a timeline that keeps nothing (the twin's): no row to build
            return
        self.timeline.append(timeline_row(
            self.pool, self.cache, step=self._steps, wall_s=time.perf_counter() - self._t0,
            prefill_computed=self.prefill_computed, prefill_saved=self.prefill_saved,
            decode_tokens=self.decode_tokens, active=len(self._active), queued=len(self._queue),
            batch_size=batch, step_s=step_s))

    def prefill_rate(self) -> float:
        """Measured prefill tokens per second of this scheduler (0 before any prefill)."""
        return self.prefill_computed / self.prefill_seconds if self.prefill_seconds else 0.0

    def seconds_saved(self) -> float:
        rate = self.prefill_rate()
        return self.prefill_saved / rate if rate else 0.0

    def stats(self) -> dict:
        """The latest timeline row plus the derived totals, as a dict."""
        row = self.timeline.rows[-1].to_dict() if self.timeline.rows else {}
        return {**row, "prefill_tok_s": self.prefill_rate(), "seconds_saved": self.seconds_saved()}
