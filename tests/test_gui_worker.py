"""The engine worker's logic on the tiny GGUF, driven step by step in the test thread (fast)."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

import engine  # noqa: E402
from app.desktop.settings import AppSettings  # noqa: E402
from app.desktop.worker import EngineWorker  # noqa: E402
from engine.chat import chat_prompt, turn_messages  # noqa: E402
from engine.loop import Accepted, Refused  # noqa: E402
from engine.scheduler import FinishEvent, TokenEvent  # noqa: E402

SYSTEM = "You help at a hardware store that sells drills, saws, screws and paint."
QUESTIONS = ["Do you sell drills?", "Do you sell paint?", "Where are the screws?"]


class Recorder:
    """Every signal of a worker, as lists (direct connections: the worker runs in this thread)."""

    NAMES = ("job_events", "stats_updated", "model_loaded", "model_load_failed", "scheduler_reset",
             "run_finished", "failed", "probe_ready", "cache_flushed")

    def __init__(self, worker: EngineWorker):
        for name in self.NAMES:
            got: list = []
            setattr(self, name, got)
            getattr(worker, name).connect(lambda *args, got=got: got.append(args[0] if len(args) == 1
                                                                             else args))

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


def run(worker: EngineWorker, limit: int = 2000) -> None:
    """Step like the worker's zero-interval timer would, until the run is over."""
    for _ in range(limit):
        if worker.scheduler is None or not (worker.loop.has_work() or worker.busy):
            return
        worker.pump()
    raise AssertionError("the run did not finish")


def job(name: str, user: str, **extra) -> dict:
    """A typed turn's `ChatFrontEnd.request` arguments, in conversation `conv-<name>`."""
    return {"system": SYSTEM, "user": user, "conversation_id": f"conv-{name}",
            "max_new_tokens": 6, "sampling": engine.SamplingParams(temperature=0.0), "namespace": "",
            **extra}


@pytest.fixture
def worker(qapp, tiny_gguf_path):
    w = EngineWorker()
    rec = Recorder(w)
    w.apply_settings(AppSettings(page_rows=4, max_streams=4, chunk_tokens=32).to_dict())
    w.load_model(tiny_gguf_path)
    assert rec.model_loaded and not rec.model_load_failed, rec.model_load_failed
    w.rec = rec
    yield w
    w._timer.stop()


def test_load_reports_the_model_and_a_broken_file_keeps_it(worker, tmp_path):
    info = worker.rec.model_loaded[-1]
    assert info["name"] == "tiny-llama" and info["arch"] == "llama"
    assert info["n_params"] == worker.model.n_params and info["context_length"] == 512
    model = worker.model
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    worker.load_model(str(bad))
    assert worker.rec.model_load_failed and "bad.gguf" in worker.rec.model_load_failed[-1]
    assert worker.model is model and len(worker.rec.model_loaded) == 1


def test_tokens_come_batched_per_step_and_later_prompts_hit_the_cache(worker):
    rec = worker.rec
    tickets = [worker.submit(job(f"t{i}", q)) for i, q in enumerate(QUESTIONS)]
    worker.pump()
    assert [t for t, _ in rec.of_kind(Accepted)] == tickets
    run(worker)
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
    snap = rec.stats_updated[-1]
    sched = worker.scheduler
    assert len(snap.timeline) == len(sched.timeline.rows)
    assert (snap.page_states == sched.page_states()).all()
    assert snap.page_states is not sched.page_states() and snap.records[0] is not sched.record(ids[0])


def test_a_follow_up_extends_the_conversation(worker):
    rec = worker.rec
    worker.submit(job("a", QUESTIONS[0]))
    run(worker)
    first = rec.request_finished[-1]
    worker.submit(job("b", "And saws?", conversation_id="conv-a"))
    run(worker)
    second = rec.request_finished[-1]
    assert second.conversation_id == "conv-a"
    assert second.n_prompt > first.n_prompt + first.n_gen
    assert second.n_cached >= (first.n_prompt // 4) * 4
    # A conversation the scheduler does not know continues from the messages the UI kept.
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]},
            {"role": "assistant", "content": first.text}, {"role": "user", "content": "And saws?"}]
    worker.submit(job("c", "And saws?", conversation_id="elsewhere", history=msgs))
    run(worker)
    third = rec.request_finished[-1]
    assert third.n_prompt == second.n_prompt and third.n_cached > 0


def test_cancel_flags_stop_requests_between_steps(worker):
    rec = worker.rec
    x = worker.submit(job("x", QUESTIONS[0], max_new_tokens=200))
    late = worker.submit(job("late", QUESTIONS[1]))
    worker.cancel([late])  # cancelled before the loop even took it
    worker.pump()
    worker.pump()
    worker.cancel([x])
    run(worker)
    reasons = {r.preview: r.finish_reason for r in rec.request_finished}
    assert set(reasons.values()) == {"cancelled"}, reasons
    x = next(r for r in rec.request_finished if r.preview.startswith("Do you sell drills"))
    assert x.n_gen < 200
    assert worker.loop.in_flight() == 0
    worker.scheduler.pool.check()


def test_probe_names_the_first_differing_token_and_the_cached_one(worker):
    rec = worker.rec
    worker.submit(job("a", "Do you sell drills and saws?"))
    run(worker)
    worker.probe({"system": SYSTEM, "user": "Do you sell paint and saws?", "namespace": ""})
    p = rec.probe_ready[-1]
    for key in ("matched_tokens", "matched_pages", "n_prompt", "stop_reason", "first_diff_index",
                "chain_id", "context_before", "prompt_token", "cached_token"):
        assert key in p
    tok = worker.model.tokenizer
    prompt = chat_prompt(tok, turn_messages(SYSTEM, "Do you sell paint and saws?"))
    cached = chat_prompt(tok, turn_messages(SYSTEM, "Do you sell drills and saws?"))
    d = p["first_diff_index"]
    assert d == next(i for i, (a, b) in enumerate(zip(prompt, cached, strict=False)) if a != b)
    assert p["matched_tokens"] == (d // 4) * 4 and p["stop_reason"] in ("miss", "token_mismatch")
    assert p["prompt_token"] == tok.decode([prompt[d]]) and p["cached_token"] == tok.decode([cached[d]])
    assert p["context_before"] == tok.decode(prompt[max(0, d - 12):d])
    # Another namespace shares nothing.
    worker.probe({"system": SYSTEM, "user": "Do you sell drills and saws?", "namespace": "other"})
    assert rec.probe_ready[-1]["matched_tokens"] == 0


def test_settings_live_now_pool_changes_when_idle(worker):
    rec = worker.rec
    sched = worker.scheduler
    worker.apply_settings(AppSettings(page_rows=4, max_streams=2, chunk_tokens=8, cache_pages=3).to_dict())
    assert worker.scheduler is sched and sched.settings.max_streams == 2 and sched.cache.max_pages == 3
    worker.submit(job("a", QUESTIONS[0], max_new_tokens=30))
    worker.pump()
    resets = len(rec.scheduler_reset)
    worker.apply_settings(AppSettings(page_rows=8, max_streams=2).to_dict())
    assert worker.scheduler is sched  # busy: the new pool waits for the run to end
    run(worker)
    assert len(rec.scheduler_reset) == resets + 1 and worker.scheduler is not sched
    assert worker.scheduler.pool.page_rows == 8 and rec.scheduler_reset[-1]["page_rows"] == 8
    with pytest.raises(ValueError):
        AppSettings(page_rows=0).validate()


def test_exceptions_become_failed_and_the_worker_goes_on(worker):
    rec = worker.rec
    bad = worker.submit({"system": "a job without its user message"})
    worker.pump()
    assert rec.request_refused[-1][0] == bad and "user message" in rec.request_refused[-1][1]
    long = worker.submit(job("ok", "tell me " * 400))  # longer than the tiny context
    worker.pump()
    assert rec.request_refused[-1][0] == long and "context" in rec.request_refused[-1][1]
    worker.apply_settings({**AppSettings().to_dict(), "page_rows": 0})  # a slot that raises
    assert rec.failed and "Page rows" in rec.failed[-1]

    calls = {"n": 0}
    real_step = worker.scheduler.step

    def broken_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real_step()

    worker.scheduler.step = broken_step
    x = worker.submit(job("x", QUESTIONS[0], max_new_tokens=20))
    run(worker)
    assert any("boom" in m for m in rec.failed)
    # the job the failed step was running ends under its ticket: what failed, and its record
    # so far ended "cancelled"
    ticket, refused = rec.of_kind(Refused)[-1]
    assert ticket == x and "boom" in refused.message and refused.record.finish_reason == "cancelled"
    assert worker.loop.in_flight() == 0
    worker.flush_cache()
    assert rec.cache_flushed and not worker.scheduler.cache.pages
    assert isinstance(worker.model, engine.Model)
