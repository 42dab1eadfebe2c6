"""Continuous batching over a paged KV pool with a prefix cache (DESIGN §4).

Each `step()` admits queued requests (attaching their cached prefix first),
then runs ONE forward pass holding every decoding stream's next token and one
prefill chunk of at most `chunk_tokens` prompt tokens, then reaps finished
streams. Prefill publishes each full prompt page to the cache as soon as it is
computed, and admission is prefix-aware: a request whose uncached prefix
another stream is prefilling waits for those pages instead of computing them
twice.
"""

from __future__ import annotations

import itertools
import time
from array import array
from collections import deque
from dataclasses import asdict, dataclass, field

import numpy as np

from .api import create_kv_pool, create_session, eval_batch
from .errors import PoolExhausted
from .kv_pool import Session
from .loader import Model
from .metrics import (
    PAGE_CACHED,
    PAGE_FREE,
    PAGE_PRIVATE,
    PAGE_SHARED,
    RequestRecord,
    RequestTokens,
    Timeline,
    TimelineRow,
    page_states,
)
from .prefix_cache import create_prefix_cache, prefix_attach, prefix_insert, prefix_probe
from .sampler import Sampler, SamplingParams
from .tokenizer import TokenStream

# Positions kept free after the answer for the turn's closing tokens.
CLOSING_SLACK = 4


class SubmitRefused(ValueError):
    """A request the scheduler will not take; the message says why."""


@dataclass
class SchedulerSettings:
    """The scheduler's knobs (validated; the app remembers them)."""

    max_streams: int = 4
    max_queue: int = 32
    chunk_tokens: int = 64
    page_rows: int = 16
    pool_pages: int | None = None
    cache_pages: int = 0
    cache_enabled: bool = True

    def validate(self) -> None:
        checks = [
            ("max_streams", self.max_streams, 1), ("max_queue", self.max_queue, 1),
            ("chunk_tokens", self.chunk_tokens, 1), ("page_rows", self.page_rows, 1),
            ("cache_pages", self.cache_pages, 0),
        ]
        if self.pool_pages is not None:
            checks.append(("pool_pages", self.pool_pages, 1))
        for name, value, low in checks:
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"bad scheduler setting: {name} must be an integer >= {low}, got {value!r}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TokenEvent:
    """A generated token and its text piece (empty while a UTF-8 character is split)."""

    request_id: int
    token_id: int
    text: str


@dataclass
class FinishEvent:
    """A request ended: stop, length or cancelled; its record has every number."""

    request_id: int
    reason: str
    record: RequestRecord


@dataclass
class Conversation:
    """A chat whose turns extend each other token for token, so each turn hits the last."""

    id: str
    namespace: str
    messages: list[dict] = field(default_factory=list)
    history_tokens: list[int] = field(default_factory=list)
    busy: bool = False


@dataclass
class Stream:
    """A request in flight."""

    record: RequestRecord
    prompt: list[int]
    sampler: Sampler
    max_new_tokens: int
    stop_ids: frozenset[int]
    text_stream: TokenStream
    conversation: Conversation | None = None
    session: Session | None = None
    generated: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    submitted_at: float = 0.0
    admitted_at: float = 0.0
    first_token_at: float | None = None
    cancel_requested: bool = False
    finish_reason: str | None = None

    @property
    def id(self) -> int:
        return self.record.id

    @property
    def prefilling(self) -> bool:
        return self.session is not None and self.session.n_past < len(self.prompt)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


class Scheduler:
    """Continuous batching with a prefix cache; drive it with `submit` and `step`."""

    def __init__(self, model: Model, max_streams: int = 4, max_queue: int = 32, chunk_tokens: int = 64,
                 page_rows: int = 16, pool_pages: int | None = None, cache_pages: int = 0,
                 cache_enabled: bool = True):
        self.settings = SchedulerSettings(max_streams, max_queue, chunk_tokens, page_rows, pool_pages,
                                          cache_pages, cache_enabled)
        self.settings.validate()
        self.model = model
        if max_streams > 1:
            model.weights.prepare_batched()  # now, not inside the first batched step's TTFT
        self.pool = create_kv_pool(model, page_rows=page_rows, max_pages=pool_pages)
        self.cache = create_prefix_cache(max_pages=cache_pages)
        self.cache.bind(self.pool)
        self.queue: deque[Stream] = deque()
        self.active: list[Stream] = []
        self.records: dict[int, RequestRecord] = {}
        self.tokens: dict[int, RequestTokens] = {}  # finished requests' prompts and donations
        self.conversations: dict[str, Conversation] = {}
        self.timeline = Timeline()
        self._ids = itertools.count(1)
        self._conv_ids = itertools.count(1)
        self._t0 = time.perf_counter()
        self._steps = 0
        self.prefill_computed = 0
        self.prefill_saved = 0
        self.prefill_seconds = 0.0
        self.decode_tokens = 0

    # submit -----------------------------------------------------------
    def submit(self, prompt: list[int] | None = None, *, messages: list[dict] | None = None,
               system: str | None = None, user: str | None = None,
               sampling: SamplingParams | None = None, max_new_tokens: int = 128,
               stop_ids: list[int] | None = None, preview: str = "",
               conversation_id: str | None = None, namespace: str = "") -> int:
        """Queue a request (tokens, chat messages, or a system/user pair); return its id."""
        if len(self.queue) >= self.settings.max_queue:
            raise SubmitRefused(f"the queue is full ({self.settings.max_queue} requests waiting)")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise SubmitRefused(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        sampling = sampling or SamplingParams()
        try:
            sampler = Sampler(sampling)
        except ValueError as e:
            raise SubmitRefused(str(e)) from e
        tok = self.model.tokenizer
        conv = None
        if prompt is None:
            if messages is None:
                if user is None:
                    raise SubmitRefused("submit needs prompt tokens, chat messages or a user message")
                messages = ([{"role": "system", "content": system}] if system else []) + [
                    {"role": "user", "content": user}]
            conv = self._conversation(conversation_id, namespace)
            if conv.history_tokens:  # a follow-up turn: the system prompt is already in the history
                messages = [m for m in messages if m.get("role") != "system"]
            if conv.busy:
                raise SubmitRefused(f"conversation {conv.id} still has a turn running")
            prompt = self._chat_prompt(conv, messages)
            preview = preview or messages[-1]["content"][:60]
        prompt = [int(t) for t in prompt]
        try:
            self._check_fits(prompt, max_new_tokens)
        except SubmitRefused:
            if conv is not None:  # a refused turn leaves the conversation as it was
                conv.messages = conv.messages[:-len(messages)]
            raise
        rid = next(self._ids)
        now = time.perf_counter()
        record = RequestRecord(id=rid, preview=preview or tok.decode(prompt[-24:]),
                               conversation_id=conv.id if conv else conversation_id,
                               namespace=namespace, n_prompt=len(prompt), submitted_s=now - self._t0)
        stream = Stream(record=record, prompt=prompt, sampler=sampler, max_new_tokens=max_new_tokens,
                        stop_ids=frozenset(stop_ids if stop_ids is not None else tok.eos_ids),
                        text_stream=tok.stream(), conversation=conv,
                        submitted_at=now)
        if conv:
            conv.busy = True
        self.records[rid] = record
        self.queue.append(stream)
        return rid

    def _conversation(self, conversation_id: str | None, namespace: str) -> Conversation:
        if conversation_id is None:
            conversation_id = f"c{next(self._conv_ids)}"
        conv = self.conversations.get(conversation_id)
        if conv is None:
            conv = self.conversations[conversation_id] = Conversation(conversation_id, namespace)
        return conv

    def _chat_prompt(self, conv: Conversation, messages: list[dict]) -> list[int]:
        """Turn N+1 is turn N's tokens plus the new messages, so it extends them exactly."""
        tok = self.model.tokenizer
        # For a follow-up, `messages` holds only the new turn; earlier turns are the history.
        before = tok.render_chat(conv.messages, add_generation_prompt=False)
        conv.messages = conv.messages + list(messages)
        after = tok.render_chat(conv.messages, add_generation_prompt=True)
        if conv.history_tokens and after.startswith(before):
            return conv.history_tokens + tok.encode(after[len(before):])
        return tok.encode(after)

    def _check_fits(self, prompt: list[int], max_new_tokens: int) -> None:
        """Refuse a prompt the model or the pool cannot take."""
        vocab = self.model.config.vocab_size
        if not prompt:
            raise SubmitRefused("the prompt is empty")
        if any(not 0 <= t < vocab for t in prompt):
            raise SubmitRefused(f"the prompt has a token outside the vocabulary (0..{vocab - 1})")
        limit = self.model.config.context_length
        if len(prompt) + 1 > limit:
            raise SubmitRefused(f"the prompt has {len(prompt)} tokens; the model's context is {limit}")
        need = self._pages_needed(len(prompt), max_new_tokens)
        if self.pool.max_pages is not None and need > self.pool.capacity:
            raise SubmitRefused(
                f"the request needs {need} KV pages ({len(prompt)} prompt + {max_new_tokens} new tokens) "
                f"but the pool has only {self.pool.capacity}")

    def _pages_needed(self, n_prompt: int, max_new: int) -> int:
        return -(-(n_prompt + max_new + CLOSING_SLACK) // self.settings.page_rows)

    # control ----------------------------------------------------------
    def cancel(self, request_id: int) -> bool:
        """Ask a queued or running request to stop; it finishes as cancelled at the next step."""
        for s in itertools.chain(self.queue, self.active):
            if s.id == request_id:
                s.cancel_requested = True
                return True
        return False

    def cancel_all(self) -> None:
        for s in itertools.chain(self.queue, self.active):
            s.cancel_requested = True

    def has_work(self) -> bool:
        return bool(self.queue or self.active)

    def flush_cache(self) -> int:
        """Evict every cached page no session holds; return how many."""
        return self.cache.evict(len(self.cache.pages))

    def page_states(self) -> np.ndarray:
        return page_states(self.pool, self.cache)

    # step -------------------------------------------------------------
    def step(self) -> list:
        """Admit, run one batched forward (decode + one prefill chunk), reap; return events."""
        t0 = time.perf_counter()
        events: list = []
        self._cancel_requested(events)
        self._admit()
        batch, n_prefill = self._run_batch(events)
        self._reap(events)
        step_s = time.perf_counter() - t0
        if n_prefill:
            self.prefill_seconds += step_s * n_prefill / max(1, batch)
        self._record(step_s, batch)
        return events

    def _cancel_requested(self, events: list) -> None:
        for s in [s for s in self.queue if s.cancel_requested]:
            self.queue.remove(s)
            s.finish_reason = "cancelled"
            events.append(self._finish(s))
        for s in self.active:
            if s.cancel_requested and s.finish_reason is None:
                s.finish_reason = "cancelled"

    def _available_pages(self) -> int:
        states = self.page_states()
        reserved = sum(max(0, self._pages_needed(len(s.prompt), s.max_new_tokens) - len(s.session.page_table))
                       for s in self.active)
        return int(np.count_nonzero(states == PAGE_FREE) + np.count_nonzero(states == PAGE_CACHED)) - reserved

    def _must_wait(self, s: Stream) -> bool:
        """True while another stream is prefilling pages of this prompt that the cache lacks."""
        if not self.settings.cache_enabled:
            return False
        rows = self.settings.page_rows
        cached = prefix_probe(self.cache, s.prompt, s.record.namespace).matched_pages
        for other in self.active:
            if other.prefilling and other.record.namespace == s.record.namespace:
                shared = min(common_prefix(s.prompt, other.prompt), len(s.prompt) - 1) // rows
                if shared > cached:
                    return True
        return False

    def _admit(self) -> None:
        for s in list(self.queue):
            if len(self.active) >= self.settings.max_streams:
                return
            if s.cancel_requested or self._must_wait(s):
                continue
            if self.pool.max_pages is not None and \
                    self._available_pages() < self._pages_needed(len(s.prompt), s.max_new_tokens):
                return  # wait for pages: keep FIFO order under memory pressure
            self.queue.remove(s)
            s.session = create_session(self.model, self.pool)
            s.admitted_at = time.perf_counter()
            s.record.queue_wait_s = s.admitted_at - s.submitted_at
            if self.settings.cache_enabled:
                matched = prefix_attach(self.cache, self.pool, s.session, s.prompt, s.record.namespace)
                if matched:
                    deepest = self.cache.by_page[s.session.page_table[-1]]
                    s.record.chain_hit = self.cache.pages[deepest].chain_id
                s.record.n_cached = matched
                self.prefill_saved += matched
            self.active.append(s)

    def _plan_prefill(self) -> list[tuple[Stream, list[int]]]:
        """This step's prefill chunk: up to `chunk_tokens` prompt tokens, shortest remainder first.

        Shortest first lets the short tails of cache hits finish (and so give their first
        token) in one step instead of queueing behind a long miss; the long prompt still
        gets whatever budget they leave.
        """
        waiting = [s for s in self.active if s.prefilling and s.finish_reason is None]
        waiting.sort(key=lambda s: len(s.prompt) - s.session.n_past)  # stable: ties keep admission order
        budget, plan = self.settings.chunk_tokens, []
        for s in waiting:
            if budget == 0:
                break
            n = s.session.n_past
            piece = s.prompt[n:n + budget]
            plan.append((s, piece))
            budget -= len(piece)
        return plan

    def _run_batch(self, events: list) -> tuple[int, int]:
        decoding = [s for s in self.active if s.finish_reason is None and not s.prefilling and s.generated]
        prefill = self._plan_prefill()
        sessions = [s.session for s in decoding] + [s.session for s, _ in prefill]
        if not sessions:
            return 0, 0
        tokens = [[s.generated[-1]] for s in decoding] + [piece for _, piece in prefill]
        try:
            logits = eval_batch(self.model, sessions, tokens)
        except PoolExhausted:
            return 0, 0  # admission reserves pages, so this only waits for a release
        self.decode_tokens += len(decoding)
        n_prefill = sum(len(p) for _, p in prefill)
        self.prefill_computed += n_prefill
        for i, s in enumerate(decoding):
            self._sample(s, logits[i], events)
        for j, (s, piece) in enumerate(prefill):
            s.record.n_prefilled += len(piece)
            if self.settings.cache_enabled:
                self._publish(s, s.prompt)  # as soon as computed, so concurrent prompts share
            if not s.prefilling:
                self._sample(s, logits[len(decoding) + j], events)
        return sum(len(t) for t in tokens), n_prefill

    def _publish(self, s: Stream, tokens: list[int]) -> None:
        """Offer the session's full pages of `tokens` to the cache, into this request's chain."""
        prefix_insert(self.cache, self.pool, s.session, tokens, s.record.preview, s.record.namespace,
                      chain_id=s.record.chain_donated)
        if s.record.chain_donated is None:
            s.record.chain_donated = self._own_chain(s)

    def _own_chain(self, s: Stream) -> int | None:
        """The chain holding this session's deepest page, if the session's own page was cached."""
        for page in reversed(s.session.page_table):
            key = self.cache.by_page.get(page)
            if key is not None:
                chain = self.cache.pages[key].chain_id
                return chain if chain != s.record.chain_hit else None
        return None

    def _sample(self, s: Stream, logits: np.ndarray, events: list) -> None:
        token = s.sampler.sample(logits, s.prompt + s.generated)
        now = time.perf_counter()
        if s.first_token_at is None:
            s.first_token_at = now
            s.record.ttft_s = now - s.admitted_at
        s.generated.append(token)
        if token in s.stop_ids:
            s.finish_reason = "stop"
            return
        piece = s.text_stream.step(token)
        s.pieces.append(piece)
        s.record.n_gen += 1
        events.append(TokenEvent(s.id, token, piece))
        if s.record.n_gen >= s.max_new_tokens or \
                s.session.n_past + 1 >= self.model.config.context_length:
            s.finish_reason = "length"

    # reap -------------------------------------------------------------
    def _reap(self, events: list) -> None:
        done = [s for s in self.active if s.finish_reason is not None]
        if not done:
            return
        for s in done:
            if s.conversation is not None and s.finish_reason != "cancelled":
                s.conversation.history_tokens = self._turn_tokens(s)
        if self.settings.cache_enabled:
            self._run_closing(done)
        for s in done:
            self.active.remove(s)
            events.append(self._finish(s))

    def _turn_tokens(self, s: Stream) -> list[int]:
        """Prompt, answer and the template's closing tokens: what the next turn starts with."""
        tok = self.model.tokenizer
        conv = s.conversation
        answer_ids = s.generated[:-1] if s.finish_reason == "stop" else s.generated
        answer = tok.decode(answer_ids)
        prev = tok.render_chat(conv.messages, add_generation_prompt=True)
        conv.messages = conv.messages + [{"role": "assistant", "content": answer}]
        full = tok.render_chat(conv.messages, add_generation_prompt=False)
        closing = tok.encode(full[len(prev) + len(answer):]) if full.startswith(prev + answer) else []
        return s.prompt + answer_ids + closing

    def _run_closing(self, done: list[Stream]) -> None:
        """Evaluate each finished turn's unevaluated tail so its donation covers the whole turn."""
        pairs = []
        for s in done:
            if s.conversation is None or s.finish_reason == "cancelled":
                continue
            turn = s.conversation.history_tokens
            n = s.session.n_past
            if turn[:n] == s.session.tokens and len(turn) > n:
                pairs.append((s.session, turn[n:]))
        if not pairs:
            return
        try:
            eval_batch(self.model, [p[0] for p in pairs], [p[1] for p in pairs])
        except (PoolExhausted, ValueError):
            pass  # donating less is fine: the next turn recomputes the tail

    def _finish(self, s: Stream) -> FinishEvent:
        now = time.perf_counter()
        r = s.record
        r.finish_reason = s.finish_reason
        r.finished_s = now - self._t0
        r.text = "".join(s.pieces)
        if s.first_token_at is not None and r.n_gen > 1:
            r.decode_tps = (r.n_gen - 1) / max(now - s.first_token_at, 1e-9)
        donated = None
        if s.session is not None:
            donated = s.session.tokens
            if self.settings.cache_enabled:
                # A cancelled stream donates what actually ran; others their whole turn.
                self._publish(s, donated)
            s.session.release()
        self.tokens[r.id] = RequestTokens(
            array("i", s.prompt), None if donated is None else array("i", donated),
            s.admitted_at - self._t0 if s.session is not None else None, r.finished_s)
        if s.conversation is not None:
            s.conversation.busy = False
            if s.finish_reason == "cancelled":
                s.conversation.messages = s.conversation.messages[:-1]
        return FinishEvent(r.id, r.finish_reason, r)

    # metrics ----------------------------------------------------------
    def _record(self, step_s: float, batch: int) -> None:
        self._steps += 1
        states = self.page_states()
        counts = np.bincount(states, minlength=4)
        c = self.cache.counters
        self.timeline.append(TimelineRow(
            step=self._steps, wall_s=time.perf_counter() - self._t0, capacity=self.pool.capacity,
            pages_private=int(counts[PAGE_PRIVATE]), pages_shared=int(counts[PAGE_SHARED]),
            pages_cached=int(counts[PAGE_CACHED]), pages_free=int(counts[PAGE_FREE]),
            chains=len(self.cache.chains), cached_pages=len(self.cache.pages), queries=c.queries,
            hits=c.hits, hit_pages=c.hit_pages, prefill_computed=self.prefill_computed,
            prefill_saved=self.prefill_saved, decode_tokens=self.decode_tokens,
            active=len(self.active), queued=len(self.queue), batch_size=batch, step_s=step_s))

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

    def run_until_done(self, on_event=None) -> None:
        """Step until every request has finished (headless runs and tests)."""
        while self.has_work():
            for ev in self.step():
                if on_event:
                    on_event(ev)
