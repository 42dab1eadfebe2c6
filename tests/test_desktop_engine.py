"""The desktop's engine side (app/desktop/desktop_engine.py) on the tiny GGUF, driven step by step
in the test thread as its driver's timer would (fast, and without Qt)."""

from __future__ import annotations

import pytest

import engine
from app.desktop.desktop_engine import (
    CacheFlushed,
    CacheNote,
    DesktopEngine,
    Failed,
    LoadFailed,
    ModelLoaded,
    ProbeReady,
    RunFinished,
    SchedulerReset,
)
from app.desktop.settings import AppSettings
from engine.chat import chat_prompt, turn_messages
from engine.loop import Accepted, Refused
from engine.scheduler import FinishEvent, TokenEvent
from engine.snapshot import Snapshot

SYSTEM = "You help at a hardware store that sells drills, saws, screws and paint."
QUESTIONS = ["Do you sell drills?", "Do you sell paint?", "Where are the screws?"]


class Recorder:
    """Everything an engine reports, as lists: each step's job events, and each kind of report."""

    KINDS = {"snapshots": (Snapshot, None), "model_loaded": (ModelLoaded, "info"),
             "model_load_failed": (LoadFailed, "message"), "scheduler_reset": (SchedulerReset, "settings"),
             "run_finished": (RunFinished, None), "failed": (Failed, "message"),
             "probe_ready": (ProbeReady, "result"), "cache_flushed": (CacheFlushed, "pages"),
             "notes": (CacheNote, "line")}

    def __init__(self):
        self.job_events: list = []
        self.reports: list = []

    def __getattr__(self, name: str) -> list:
        """The reports of one kind, in order (`model_loaded`: each ModelLoaded's info, ...)."""
        if name not in Recorder.KINDS:
            raise AttributeError(name)
        kind, field = Recorder.KINDS[name]
        return [getattr(r, field) if field else r for r in self.reports if isinstance(r, kind)]

    def of_kind(self, kind) -> list:
        """(ticket, event) of every job event of this kind, in order."""
        return [(ticket, ev) for batch in self.job_events for ticket, ev in batch if isinstance(ev, kind)]

    @property
    def request_finished(self) -> list:
        """The finished records, in order."""
        return [ev.record for _, ev in self.of_kind(FinishEvent)]

    @property
    def request_refused(self) -> list:
        """(ticket, why) of every refused job, in order."""
        return [(ticket, ev.message) for ticket, ev in self.of_kind(Refused)]


def recorded() -> DesktopEngine:
    """A DesktopEngine reporting into a Recorder (its `rec`), woken as its driver wakes it."""
    rec = Recorder()
    e = DesktopEngine(rec.job_events.append, rec.reports.append)
    e.loop.wake = e.begin_run  # what the driver does when a job arrives and its timer is idle
    e.rec = rec
    return e


def run(eng: DesktopEngine, limit: int = 2000) -> None:
    """Step like the driver's zero-interval timer would, until the run is over."""
    for _ in range(limit):
        if eng.scheduler is None or not (eng.loop.has_work() or eng.busy):
            return
        eng.step()
    raise AssertionError("the run did not finish")


def job(name: str, user: str, **extra) -> dict:
    """A typed turn's `ChatFrontEnd.request` arguments, in conversation `conv-<name>`."""
    return {"system": SYSTEM, "user": user, "conversation_id": f"conv-{name}",
            "max_new_tokens": 6, "sampling": engine.SamplingParams(temperature=0.0), "namespace": "",
            **extra}


@pytest.fixture
def eng(tiny_gguf_path):
    w = recorded()
    w.apply_settings(AppSettings(page_rows=4, max_streams=4, chunk_tokens=32).to_dict())
    w.load_model(tiny_gguf_path)
    assert w.rec.model_loaded and not w.rec.model_load_failed, w.rec.model_load_failed
    return w


def test_load_reports_the_model_and_a_broken_file_keeps_it(eng, tmp_path):
    info = eng.rec.model_loaded[-1]
    assert info["name"] == "tiny-llama" and info["arch"] == "llama"
    assert info["n_params"] == eng.model.n_params and info["context_length"] == 512
    model = eng.model
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    eng.load_model(str(bad))
    assert eng.rec.model_load_failed and "bad.gguf" in eng.rec.model_load_failed[-1]
    assert eng.model is model and len(eng.rec.model_loaded) == 1


def test_tokens_come_batched_per_step_and_later_prompts_hit_the_cache(eng):
    rec = eng.rec
    tickets = [eng.submit(job(f"t{i}", q)) for i, q in enumerate(QUESTIONS)]
    eng.step()
    assert [t for t, _ in rec.of_kind(Accepted)] == tickets
    run(eng)
    assert len(rec.run_finished) == 1 and not rec.failed
    done = {ticket: ev.record for ticket, ev in rec.of_kind(FinishEvent)}
    assert sorted(done) == sorted(tickets)
    # One job_events per step, each a list of (ticket, event) in order (a stream may give several
    # tokens in one step: speculative decoding); the pieces rebuild the texts, ticket by ticket.
    texts: dict[int, str] = {}
    for batch in rec.job_events:
        assert isinstance(batch, list) and batch and {ticket for ticket, _ in batch} <= set(done)
        for ticket, ev in batch:
            if isinstance(ev, TokenEvent):
                texts[ticket] = texts.get(ticket, "") + ev.text
    for ticket, r in done.items():
        assert texts.get(ticket, "") == r.text
    ids = sorted(r.id for r in done.values())
    assert done[ids[0]].n_cached == 0
    assert done[ids[1]].n_cached > 0 and done[ids[2]].n_cached > 0
    # Snapshots are copies: the last one matches the scheduler.
    snap = rec.snapshots[-1]
    sched = eng.scheduler
    assert len(snap.timeline) == len(sched.timeline.rows)
    assert (snap.page_states == sched.page_states()).all()
    assert snap.page_states is not sched.page_states() and snap.records[0] is not sched.record(ids[0])


def test_a_follow_up_extends_the_conversation(eng):
    rec = eng.rec
    eng.submit(job("a", QUESTIONS[0]))
    run(eng)
    first = rec.request_finished[-1]
    eng.submit(job("b", "And saws?", conversation_id="conv-a"))
    run(eng)
    second = rec.request_finished[-1]
    assert second.conversation_id == "conv-a"
    assert second.n_prompt > first.n_prompt + first.n_gen
    assert second.n_cached >= (first.n_prompt // 4) * 4
    # A conversation the scheduler does not know continues from the messages the UI kept.
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]},
            {"role": "assistant", "content": first.text}, {"role": "user", "content": "And saws?"}]
    eng.submit(job("c", "And saws?", conversation_id="elsewhere", history=msgs))
    run(eng)
    third = rec.request_finished[-1]
    assert third.n_prompt == second.n_prompt and third.n_cached > 0


def test_cancel_flags_stop_requests_between_steps(eng):
    rec = eng.rec
    x = eng.submit(job("x", QUESTIONS[0], max_new_tokens=200))
    late = eng.submit(job("late", QUESTIONS[1]))
    eng.cancel([late])  # cancelled before the loop even took it
    eng.step()
    eng.step()
    eng.cancel([x])
    run(eng)
    reasons = {r.preview: r.finish_reason for r in rec.request_finished}
    assert set(reasons.values()) == {"cancelled"}, reasons
    x = next(r for r in rec.request_finished if r.preview.startswith("Do you sell drills"))
    assert x.n_gen < 200
    assert eng.loop.in_flight() == 0
    eng.scheduler.pool.check()


def test_probe_names_the_first_differing_token_and_the_cached_one(eng):
    rec = eng.rec
    eng.submit(job("a", "Do you sell drills and saws?"))
    run(eng)
    eng.probe({"system": SYSTEM, "user": "Do you sell paint and saws?", "namespace": ""})
    p = rec.probe_ready[-1]
    for key in ("matched_tokens", "matched_pages", "n_prompt", "stop_reason", "first_diff_index",
                "chain_id", "context_before", "prompt_token", "cached_token"):
        assert key in p
    tok = eng.model.tokenizer
    prompt = chat_prompt(tok, turn_messages(SYSTEM, "Do you sell paint and saws?"))
    cached = chat_prompt(tok, turn_messages(SYSTEM, "Do you sell drills and saws?"))
    d = p["first_diff_index"]
    assert d == next(i for i, (a, b) in enumerate(zip(prompt, cached, strict=False)) if a != b)
    assert p["matched_tokens"] == (d // 4) * 4 and p["stop_reason"] in ("miss", "token_mismatch")
    assert p["prompt_token"] == tok.decode([prompt[d]]) and p["cached_token"] == tok.decode([cached[d]])
    assert p["context_before"] == tok.decode(prompt[max(0, d - 12):d])
    # Another namespace shares nothing.
    eng.probe({"system": SYSTEM, "user": "Do you sell drills and saws?", "namespace": "other"})
    assert rec.probe_ready[-1]["matched_tokens"] == 0


def test_settings_live_now_pool_changes_when_idle(eng):
    rec = eng.rec
    sched = eng.scheduler
    eng.apply_settings(AppSettings(page_rows=4, max_streams=2, chunk_tokens=8, cache_pages=3).to_dict())
    assert eng.scheduler is sched and sched.settings.max_streams == 2 and sched.cache.max_pages == 3
    eng.submit(job("a", QUESTIONS[0], max_new_tokens=30))
    eng.step()
    resets = len(rec.scheduler_reset)
    eng.apply_settings(AppSettings(page_rows=8, max_streams=2).to_dict())
    assert eng.scheduler is sched  # busy: the new pool waits for the run to end
    run(eng)
    assert len(rec.scheduler_reset) == resets + 1 and eng.scheduler is not sched
    assert eng.scheduler.pool.page_rows == 8 and rec.scheduler_reset[-1]["page_rows"] == 8
    with pytest.raises(ValueError):
        AppSettings(page_rows=0).validate()


def test_exceptions_become_failed_and_the_worker_goes_on(eng):
    rec = eng.rec
    bad = eng.submit({"system": "a job without its user message"})
    eng.step()
    assert rec.request_refused[-1][0] == bad and "user message" in rec.request_refused[-1][1]
    long = eng.submit(job("ok", "tell me " * 400))  # longer than the tiny context
    eng.step()
    assert rec.request_refused[-1][0] == long and "context" in rec.request_refused[-1][1]
    eng.apply_settings({**AppSettings().to_dict(), "page_rows": 0})  # a request that raises
    assert rec.failed and "Page rows" in rec.failed[-1]

    calls = {"n": 0}
    real_step = eng.scheduler.step

    def broken_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real_step()

    eng.scheduler.step = broken_step
    x = eng.submit(job("x", QUESTIONS[0], max_new_tokens=20))
    run(eng)
    assert any("boom" in m for m in rec.failed)
    # the job the failed step was running ends under its ticket: what failed, and its record
    # so far ended "cancelled"
    ticket, refused = rec.of_kind(Refused)[-1]
    assert ticket == x and "boom" in refused.message and refused.record.finish_reason == "cancelled"
    assert eng.loop.in_flight() == 0
    eng.flush_cache()
    assert rec.cache_flushed and not eng.scheduler.cache.pages
    assert isinstance(eng.model, engine.Model)
