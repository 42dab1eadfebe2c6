"""The one owner loop of a Scheduler (docs/design.md §5): every front end goes through it.

The desktop worker, `prefixlab serve` and `prefixlab run` alike hand it `Job`s from any
thread (`submit`, `cancel`, both by the job's ticket), and the thread that owns the scheduler
calls `step`: take the inbox (the chat front end turns each job into a token request; the
scheduler queues it), apply cancels, run one scheduler step, and send each job's events to its
sink. One submit path, one cancel set, one stop rule (`stop`), one recovery (`StepFailed`).
A job's sink is the only way back for everything about it, called on the owner thread with,
in order: `Accepted` or `Refused`, the request's `TokenEvent`s and its `FinishEvent` (or a
`Refused` when the engine fails or restarts under it); sinks must be quick (a server's is
`loop.call_soon_threadsafe`). `observers` see the loop itself after each drain (its queue and
cache, e.g. the server's friendliness probe), never a job's events.
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from .conversations import ChatFrontEnd
from .metrics import RequestRecord
from .scheduler import (
    FinishEvent,
    QueueFull,
    Request,
    Scheduler,
    SchedulerSettings,
    SubmitRefused,
    TokenEvent,
)

Sink = Callable[[object], None]
STOP_STEPS = 3       # steps allowed to reap cancelled streams: one is enough, the rest is a guard
IDLE_WAIT_S = 0.5    # an idle `serve_forever` also wakes this often to notice a stop


@dataclass
class Accepted:
    """The scheduler took the job's request: its id and prompt length."""

    request_id: int
    n_prompt: int


@dataclass
class Refused:
    """The job never ran, or the engine failed or restarted under it; `status` is the HTTP status.
    A request that had run comes with its record so far, ended "cancelled" (what a window shows)."""

    message: str
    status: int = 400
    record: RequestRecord | None = None


@dataclass
class Job:
    """One submission: `ChatFrontEnd.request` keyword arguments, and where its events go.

    `ticket` is the job's one id, given by `EngineLoop.submit`: the submitter keys its books by
    it and cancels by it; `request_id` is only the scheduler's own name for the request."""

    chat_args: dict
    sink: Sink | None = None
    client: str = ""          # where it came from ("": typed in the window or a script)
    arrival: float = field(default_factory=time.perf_counter)
    tenant: str = ""          # the API key's tenant of a served job (views of served traffic)
    ticket: int = 0
    request_id: int | None = None
    request: Request | None = None
    prompt: list[int] | None = None

    def send(self, event) -> None:
        if self.sink is not None:
            self.sink(event)


class StepFailed(RuntimeError):
    """A scheduler step raised; the loop refused its open jobs (500) and reaped their streams."""


class EngineLoop:
    """Owns one Scheduler (and its chat front end); any thread submits, the owner steps.

    `EngineLoop(model, settings)` builds the scheduler; `reset(model, settings)` builds a new
    one (a new model or pool); `EngineLoop()` starts with none (a model still loading)."""

    def __init__(self, model=None, settings: SchedulerSettings | None = None, runner=None):
        self._lock = threading.Lock()
        self._inbox: list[Job] = []
        self._cancels: dict[int, str] = {}   # ticket -> the finish reason asked for
        self._tickets = itertools.count(1)
        self._jobs: dict[int, Job] = {}      # ticket -> job, until it ends
        self._by_request: dict[int, Job] = {}  # the scheduler's events name requests, not tickets
        self._wakeup = threading.Event()
        self.wake: Callable[[], None] = self._wakeup.set  # a Qt owner replaces it with a signal
        self.observers: list[Callable[[EngineLoop], None]] = []  # after each drain (owner thread)
        self.step_error: str | None = None   # the last step that raised (the loop lives on)
        self.scheduler: Scheduler | None = None
        self.chat: ChatFrontEnd | None = None
        if model is not None:
            self.reset(model, settings, runner)

    # any thread -------------------------------------------------------------
    def submit(self, job: Job) -> int:
        """Queue a job for the owner's next step; return its ticket (for `cancel`)."""
        with self._lock:
            job.ticket = next(self._tickets)
            self._inbox.append(job)
            self._jobs[job.ticket] = job
        self.wake()
        return job.ticket

    def cancel(self, ticket: int, reason: str = "cancelled") -> None:
        """Stop a job at the owner's next step; it finishes with `reason` ("stop" for a stop
        string), the first one asked for."""
        with self._lock:
            if ticket in self._jobs:
                self._cancels.setdefault(ticket, reason)
        self.wake()

    def cancel_all(self, served_only: bool = False) -> None:
        """Stop every job (only those from a client, e.g. HTTP, when `served_only`) at the next step."""
        with self._lock:
            for ticket, job in self._jobs.items():
                if job.client or not served_only:
                    self._cancels.setdefault(ticket, "cancelled")
        self.wake()

    def in_flight(self) -> int:
        """Jobs submitted and not ended yet."""
        with self._lock:
            return len(self._jobs)

    # owner thread -----------------------------------------------------------
    def reset(self, model=None, settings: SchedulerSettings | None = None, runner=None) -> None:
        """A new scheduler over `model` with `settings` (None: no model): the old one's jobs are
        refused. `runner` runs its passes (engine.scheduler.Runner; None: the model's forward pass,
        the twin's step-cost model in app/replay/twin.py)."""
        if isinstance(model, Scheduler):
            raise TypeError("EngineLoop builds its own scheduler: pass (model, settings), not a Scheduler")
        if self.scheduler is not None:
            self.fail_all("the engine restarted (a new model or pool settings); retry", 503)
        self.scheduler = Scheduler(model, settings, runner) if model is not None else None
        self.chat = ChatFrontEnd(model.tokenizer) if model is not None else None

    def has_work(self, closing: bool = True) -> bool:
        """Jobs or requests not yet ended, and (`closing`) ended turns' closing tokens to run."""
        s = self.scheduler
        return bool(self._inbox or self._cancels) or (s is not None and s.has_work(closing))

    def drain(self) -> None:
        """Turn queued jobs into requests (each job's sink hears `Accepted` or `Refused`), apply
        cancels, then let the observers look at the queue."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, {}
        for job in inbox:
            self._submit_one(job)
        for ticket, reason in cancels.items():
            job = self._jobs.get(ticket)
            if job is not None and job.request_id is not None:
                self.scheduler.cancel(job.request_id, reason)
        for observe in self.observers:
            observe(self)

    def _submit_one(self, job: Job) -> None:
        s = self.scheduler
        if s is None:
            self._refuse(job, "no model is loaded yet", 503)
            return
        request = None
        try:
            s.check_room()  # before the chat template runs: a busy server refuses cheaply
            request = self.chat.request(**job.chat_args, client=job.client, arrival=job.arrival)
            rid = s.submit(request)
        except QueueFull as e:
            self._refuse(job, str(e), 503, request)
            return
        except (SubmitRefused, ValueError) as e:  # TemplateError and UnicodeError are ValueErrors
            self._refuse(job, str(e), 400, request)
            return
        except Exception as e:  # noqa: BLE001 - one job's failure must not end the loop
            self._refuse(job, f"the request failed: {type(e).__name__}: {e}", 500, request)
            return
        job.request_id, job.request, job.prompt = rid, request, request.prompt
        self._by_request[rid] = job
        job.send(Accepted(rid, len(request.prompt)))

    def _refuse(self, job: Job, message: str, status: int, request=None) -> None:
        if request is not None:
            self.chat.ended(request)
        self._forget(job)
        ran = self.scheduler.record(job.request_id) if job.request_id is not None else None
        job.send(Refused(message, status, _cancelled(ran) if ran is not None else None))

    def _forget(self, job: Job) -> None:
        with self._lock:
            self._jobs.pop(job.ticket, None)
        if job.request_id is not None:
            self._by_request.pop(job.request_id, None)

    def queued(self) -> list[tuple[Job, list[int], str]]:
        """The jobs the scheduler still queues (not yet admitted): each with its prompt and namespace."""
        s = self.scheduler
        if s is None:
            return []
        return [(self._by_request[rid], prompt, namespace) for rid, prompt, namespace in s.queued()
                if rid in self._by_request]

    def step(self) -> None:
        """Drain, run one scheduler step if there is work, and send each job its events.

        A step that raises refuses the open jobs (500) and reaps their streams; the loop lives
        on (on a fresh scheduler if even reaping failed) and `StepFailed` says what happened.
        """
        self.drain()
        s = self.scheduler
        if s is None or not s.has_work():
            return
        try:
            events = s.step()
        except Exception as e:  # noqa: BLE001 - recovered below, reported by StepFailed
            self.step_error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
            self._recover()
            raise StepFailed(self.step_error) from e
        self._dispatch(events)

    def _dispatch(self, events: list) -> None:
        """Send each job its events; a finish ends the job."""
        for ev in events:
            job = self._by_request.get(ev.request_id)
            if job is None:
                continue
            if isinstance(ev, TokenEvent):
                job.send(ev)
            elif isinstance(ev, FinishEvent):
                self._forget(job)
                self.chat.ended(job.request)
                job.send(FinishEvent(ev.request_id, ev.reason, copy.copy(ev.record)))

    def stop(self) -> None:
        """Cancel everything and reap it (each job's finish comes as `cancelled`); jobs not
        finished by then are refused."""
        s = self.scheduler
        self.cancel_all()
        self.drain()
        for _ in range(STOP_STEPS):
            if s is None or not s.has_work():
                break
            self._dispatch(s.step())
        self.fail_all("the engine is shutting down", 503)

    def _recover(self) -> None:
        """After a failed step: refuse the open jobs, cancel and reap; a new scheduler if that fails."""
        self.fail_all(f"the engine failed: {self.step_error.splitlines()[0]}", 500)
        s = self.scheduler
        try:
            s.cancel_all()
            for _ in range(STOP_STEPS):
                if not s.has_work():
                    break
                s.step()
        except Exception:  # noqa: BLE001 - the pool may be inconsistent: start over on it
            self.reset(s.model, s.settings)

    def fail_all(self, message: str, status: int = 503) -> None:
        """Refuse every job not ended yet (owner thread)."""
        with self._lock:
            jobs = list(self._jobs.values())
            self._inbox.clear()
            self._cancels.clear()
        for job in jobs:
            self._refuse(job, message, status, job.request)

    # driving it ---------------------------------------------------------------
    def run_until_done(self, settle: bool = True) -> None:
        """Step until every job has ended (headless runs, scripts, tests). `settle=False` returns
        once every request has ended, before the finished turns' closing tokens run: they only
        serve later requests, so a process about to exit with its cache need not compute them."""
        while self.has_work(closing=settle):
            self.step()

    def serve_forever(self, stopping: threading.Event) -> None:
        """Step while there is work and sleep until woken, until `stopping` is set (a thread's body)."""
        while not stopping.is_set():
            self._wakeup.clear()
            if not self.has_work():
                self._wakeup.wait(IDLE_WAIT_S)
                continue
            try:
                self.step()
            except StepFailed:
                continue  # reported through the jobs' sinks and `step_error`
        self.stop()

    def submit_now(self, sink: Sink | None = None, client: str = "", arrival: float | None = None,
                   **chat_args) -> int:
        """Submit and drain at once on the owner thread; return the request id (SubmitRefused
        says why not). `sink` hears the job's events after that. For scripts and tests that own
        the loop."""
        answers: list = []
        job = Job(chat_args, answers.append, client=client)
        if arrival is not None:
            job.arrival = arrival
        self.submit(job)
        self.drain()
        if isinstance(answers[0], Refused):
            raise SubmitRefused(answers[0].message)
        job.sink = sink
        return answers[0].request_id


def _cancelled(record: RequestRecord) -> RequestRecord:
    record = copy.copy(record)
    record.finish_reason = "cancelled"
    return record
