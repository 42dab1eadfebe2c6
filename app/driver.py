"""Driving a Scheduler from one thread, with no Qt: submit by tag, cancel from any thread, step, recover.

The desktop's Qt worker (app/worker.py) wraps an `EngineDriver`; any other loop that owns a
scheduler on one thread (a server's, a script's) can use it the same way: call `submit`,
`request_cancel` (thread-safe) and `step` on the owning thread, and hand the returned events on.
"""

from __future__ import annotations

import copy
import threading

from engine.sampler import SamplingParams
from engine.scheduler import FinishEvent, Scheduler, SubmitRefused, TokenEvent

STOP_STEPS = 3  # steps allowed to reap cancelled streams; one is enough, the rest is a guard


class EngineDriver:
    """One scheduler, its requests known by the caller's tags, and a cancel set other threads fill."""

    def __init__(self, scheduler: Scheduler | None = None):
        self.scheduler = scheduler
        self._lock = threading.Lock()
        self._cancel_tags: set[str] = set()
        self._rid_of: dict[str, int] = {}
        self._tag_of: dict[int, str] = {}

    def reset(self, scheduler: Scheduler | None) -> None:
        """Drive a new scheduler; the old one's requests are forgotten."""
        self.scheduler = scheduler
        self._tag_of.clear()
        self._rid_of.clear()

    def request_cancel(self, tags) -> None:
        """Stop these requests (by the tags they were submitted with) at the next step; any thread."""
        with self._lock:
            self._cancel_tags.update(tags)

    def submit(self, job: dict) -> int:
        """Queue one request and return its id; SubmitRefused or ValueError says why not.

        A job is a dict: tag, system, user, conversation_id, messages (the whole chat, used
        when the scheduler no longer knows the conversation), max_new_tokens, sampling
        (a SamplingParams), namespace.
        """
        tag = job["tag"]
        try:
            rid = self._submit(job)
        except (SubmitRefused, ValueError):
            with self._lock:
                self._cancel_tags.discard(tag)
            raise
        self._rid_of[tag] = rid
        self._tag_of[rid] = tag
        return rid

    def _submit(self, job: dict) -> int:
        s = self.scheduler
        cid = job.get("conversation_id")
        conv = s.conversations.get(cid) if cid else None
        common = {"max_new_tokens": int(job.get("max_new_tokens", 64)),
                  "sampling": copy.copy(job.get("sampling") or SamplingParams()),
                  "namespace": job.get("namespace", ""), "conversation_id": cid}
        messages = job.get("messages")
        if messages and (conv is None or not conv.history_tokens):
            # The scheduler lost this conversation (new pool, or its first turn was stopped):
            # send the whole history the caller kept.
            return s.submit(messages=messages, **common)
        return s.submit(system=job.get("system") or None, user=job["user"], **common)

    def has_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_work()

    def step(self) -> list:
        """Apply pending cancels and run one step if there is work; return its events."""
        if self.scheduler is None:
            return []
        self._apply_cancels()
        events = self.scheduler.step() if self.scheduler.has_work() else []
        self._forget_finished(events)
        return events

    def stop_everything(self, on_events) -> None:
        """Cancel every request and reap them, handing each step's events (finishes come as
        `cancelled`) to `on_events` at once, so a later failing step loses none of them."""
        s = self.scheduler
        if s is None or not s.has_work():
            return
        s.cancel_all()
        for _ in range(STOP_STEPS):
            events = s.step()
            self._forget_finished(events)
            on_events(events)
            if not s.has_work():
                break

    def abandon(self) -> list:
        """After a failure even cancelling could not mend: records of the open requests, as cancelled."""
        out = []
        for rid in list(self._tag_of):
            record = self.scheduler.records.get(rid) if self.scheduler is not None else None
            if record is not None:
                record = copy.copy(record)
                record.finish_reason = "cancelled"
                out.append(record)
        self._tag_of.clear()
        self._rid_of.clear()
        return out

    def open_tags(self) -> set[str]:
        """Tags of requests not finished yet, and of cancels not applied yet."""
        with self._lock:
            return set(self._rid_of) | self._cancel_tags

    def _apply_cancels(self) -> None:
        with self._lock:
            tags = list(self._cancel_tags)
        for tag in tags:
            rid = self._rid_of.get(tag)
            if rid is not None:
                self.scheduler.cancel(rid)

    def _forget_finished(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, FinishEvent):
                tag = self._tag_of.pop(ev.request_id, None)
                if tag is not None:
                    self._rid_of.pop(tag, None)
                    with self._lock:
                        self._cancel_tags.discard(tag)


def token_pieces(events: list) -> list[tuple[int, str]]:
    """(request id, text) of a step's token events."""
    return [(ev.request_id, ev.text) for ev in events if isinstance(ev, TokenEvent)]


def finished_records(events: list) -> list:
    """Copies of the records of a step's finish events."""
    return [copy.copy(ev.record) for ev in events if isinstance(ev, FinishEvent)]
