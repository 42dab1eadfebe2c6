"""The hand-off between HTTP handlers and the one thread that owns a Scheduler.

HTTP handlers (any thread, usually the asyncio loop's) call `submit` and
`cancel`; the owner thread calls `drain` before each scheduler step and
`dispatch` with the step's events. Each request's sink is called on the owner
thread with, in order: an `Accepted` or a `Refused`, the request's
`TokenEvent`s and its `FinishEvent`. Sinks must be quick and thread-safe
(the server's sink is `loop.call_soon_threadsafe`). The same broker serves the
headless `EngineLoop` and the desktop app's worker, so served requests run on
the scheduler that also runs typed prompts.
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.prefix_cache import ProbeResult, prefix_probe
from engine.scheduler import FinishEvent, SubmitRefused, TokenEvent

Sink = Callable[[object], None]


@dataclass
class Accepted:
    """The scheduler took the request: its id and prompt length."""

    request_id: int
    n_prompt: int


@dataclass
class Refused:
    """The scheduler would not take the request; `status` is the HTTP status to answer."""

    message: str
    status: int = 400


@dataclass
class Job:
    """One submission: `Scheduler.submit` keyword arguments plus where its events go."""

    submit_kwargs: dict
    sink: Sink
    client: str = ""
    arrival: float = field(default_factory=time.perf_counter)
    ticket: int = 0
    request_id: int | None = None
    prompt: list[int] | None = None
    probe: ProbeResult | None = None
    probed_at: tuple[int, int] | None = None  # the cache's (inserted, evicted) counts at the probe


class RequestBroker:
    """Thread-safe inbox of submissions and cancels; routes a step's events to their sinks."""

    def __init__(self, wake: Callable[[], None] | None = None):
        self._lock = threading.Lock()
        self._inbox: list[Job] = []
        self._cancels: dict[int, str] = {}  # ticket -> the finish reason asked for
        self._tickets = itertools.count(1)
        self._by_ticket: dict[int, Job] = {}
        self._by_request: dict[int, Job] = {}
        self.wake = wake or (lambda: None)
        self.observers: list[Callable[[Job, FinishEvent], None]] = []

    # any thread -------------------------------------------------------------
    def submit(self, job: Job) -> int:
        """Queue a job for the owner thread; return its ticket (for `cancel`)."""
        with self._lock:
            job.ticket = next(self._tickets)
            self._inbox.append(job)
            self._by_ticket[job.ticket] = job
        self.wake()
        return job.ticket

    def cancel(self, ticket: int, reason: str = "cancelled") -> None:
        """Stop a job (queued here or running) at the owner's next drain; it finishes with
        `reason` ("stop" for a stop string), the first one asked for."""
        with self._lock:
            if ticket in self._by_ticket:
                self._cancels.setdefault(ticket, reason)
        self.wake()

    def cancel_request(self, request_id: int) -> None:
        """Stop a job by the scheduler's request id (any thread)."""
        job = self._by_request.get(request_id)
        if job is not None:
            self.cancel(job.ticket)

    def cancel_all(self) -> None:
        """Stop every job at the owner's next drain."""
        with self._lock:
            for ticket in self._by_ticket:
                self._cancels.setdefault(ticket, "cancelled")
        self.wake()

    def in_flight(self) -> int:
        """Jobs submitted and not finished (or refused) yet."""
        with self._lock:
            return len(self._by_ticket)

    # owner thread -----------------------------------------------------------
    def drain(self, scheduler) -> list[Job]:
        """Submit queued jobs and apply cancels; return the jobs the scheduler accepted."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, {}
        accepted = []
        for job in inbox:
            if job.ticket in cancels:  # gone before it reached the scheduler
                del cancels[job.ticket]
                self._forget(job)
                continue
            if self._submit_one(scheduler, job):
                accepted.append(job)
        for ticket, reason in cancels.items():
            job = self._by_ticket.get(ticket)
            if job is not None and job.request_id is not None:
                scheduler.cancel(job.request_id, reason)
        self._probe_queued(scheduler)
        return accepted

    def _submit_one(self, scheduler, job: Job) -> bool:
        if len(scheduler.queue) >= scheduler.settings.max_queue:
            self._refuse(job, f"the server is busy: {scheduler.settings.max_queue} requests are waiting; "
                              "retry later", 503)
            return False
        try:
            rid = scheduler.submit(**job.submit_kwargs, arrival=job.arrival, client=job.client)
        except (SubmitRefused, ValueError) as e:
            self._refuse(job, str(e), 400)
            return False
        job.request_id = rid
        self._by_request[rid] = job
        job.prompt = next(s.prompt for s in scheduler.queue if s.id == rid)
        job.sink(Accepted(rid, len(job.prompt)))
        return True

    def _refuse(self, job: Job, message: str, status: int) -> None:
        self._forget(job)
        job.sink(Refused(message, status))

    def _forget(self, job: Job) -> None:
        with self._lock:
            self._by_ticket.pop(job.ticket, None)
        if job.request_id is not None:
            self._by_request.pop(job.request_id, None)

    def _probe_queued(self, scheduler) -> None:
        """Probe each of our queued prompts now: the last probe before admission explains its attach."""
        c = scheduler.cache.counters
        stamp = (c.inserted_pages, c.evicted_pages)
        for s in scheduler.queue:
            job = self._by_request.get(s.id)
            if job is not None and job.probed_at != stamp:  # the cache changed since the last probe
                job.probe = prefix_probe(scheduler.cache, s.prompt, s.record.namespace)
                job.probed_at = stamp

    def dispatch(self, scheduler, events: list) -> None:
        """Send each of our requests' events to its sink (other requests' events are left alone)."""
        for ev in events:
            job = self._by_request.get(ev.request_id)
            if job is None:
                continue
            if isinstance(ev, TokenEvent):
                job.sink(ev)
            elif isinstance(ev, FinishEvent):
                ev = FinishEvent(ev.request_id, ev.reason, copy.copy(ev.record))
                self._forget(job)
                # A client resends the whole chat each turn: the cache, not the scheduler's
                # conversation, carries it over, so the one-turn conversation can go.
                scheduler.conversations.pop(ev.record.conversation_id, None)
                for observe in self.observers:
                    observe(job, ev)
                job.sink(ev)

    def fail_all(self, message: str, status: int = 503) -> None:
        """Refuse every job not yet finished (the scheduler went away); owner thread only."""
        with self._lock:
            jobs = list(self._by_ticket.values())
            self._inbox.clear()
            self._cancels.clear()
        for job in jobs:
            self._refuse(job, message, status)
