"""The step's shape on the tiny model: one forward pass per step (a finished turn's closing
tokens ride in the next one), pages taken at admission, TTFT from arrival, live settings."""

from __future__ import annotations

import time

import pytest

import engine.scheduler as es
from engine.block_manager import pages_for
from engine.chat import CLOSING_SLACK
from engine.loop import EngineLoop
from engine.scheduler import FinishEvent, SchedulerSettings, SubmitRefused
from tests.loop_helpers import Heard

PROMPT = list(range(10, 50))  # 40 tokens


def counting_forward(monkeypatch) -> list[list[int]]:
    """Record the token count of each session in every forward pass the scheduler runs."""
    passes: list[list[int]] = []
    real = es.eval_batch

    def wrapped(model, sessions, token_lists, **kw):
        passes.append([len(t) for t in token_lists])
        return real(model, sessions, token_lists, **kw)

    monkeypatch.setattr(es, "eval_batch", wrapped)
    return passes


def test_a_finished_turn_closes_in_the_next_steps_batch_and_the_next_turn_hits_all_of_it(
        tiny_model, monkeypatch):
    loop = EngineLoop(tiny_model, SchedulerSettings(page_rows=4))
    sch = loop.scheduler
    passes = counting_forward(monkeypatch)
    heard = Heard(loop)
    first = heard.submit(system="You are tiny.", user="hello there", conversation_id="c", max_new_tokens=6,
                         stop_ids=[])
    steps = 0
    finished_at = None
    while loop.has_work():
        events = heard.step()
        steps += 1
        if any(isinstance(e, FinishEvent) for e in events):
            finished_at = steps
            assert sch._closing and not sch._active     # the session stays for its closing tokens
    assert len(passes) == steps                        # never a second pass in a step
    history = list(loop.chat.conversation("c").history_tokens)
    record = sch.record(first)
    tail = len(history) - (record.n_prompt + record.n_gen - 1)  # last answer token + closing
    assert 1 < tail <= CLOSING_SLACK and steps == finished_at + 1
    assert passes[-1] == [tail]                        # the closing step ran only those tokens
    second = loop.submit_now(user="and again", conversation_id="c", max_new_tokens=3, stop_ids=[])
    loop.run_until_done()
    t2 = sch.record(second)
    assert t2.n_cached == min(len(history), t2.n_prompt - 1) // 4 * 4
    assert sch.pool.num_used_pages == len(sch.cache.pages)


def test_a_run_that_keeps_no_cache_ends_with_its_answers_not_its_closing_pass(tiny_model, monkeypatch):
    """`prefixlab run` without a saved cache, report or trace exits after the last answer: the
    closing tokens (computed only for later requests) are not run; settling runs them."""
    loop = EngineLoop(tiny_model, SchedulerSettings(page_rows=4))
    sch = loop.scheduler
    passes = counting_forward(monkeypatch)
    finished: list[int] = []

    def on_event(ev) -> None:
        if isinstance(ev, FinishEvent):
            finished.append(ev.request_id)

    ids = [loop.submit_now(on_event, system="You are tiny.", user=u, max_new_tokens=5, stop_ids=[])
           for u in ("hi", "yo")]
    loop.run_until_done(settle=False)
    assert sorted(finished) == ids and all(sch.record(i).n_gen == 5 for i in ids)
    answered = len(passes)
    assert sch.n_running() == 2 and not loop.has_work(closing=False)  # both turns await closing
    loop.run_until_done()                               # settling: one more pass closes both
    assert len(passes) == answered + 1 and sch.n_running() == 0 and not loop.has_work()


def test_pages_are_taken_at_admission_and_forward_never_allocates(tiny_model):
    loop = EngineLoop(tiny_model, SchedulerSettings(page_rows=4, pool_pages=40, cache_enabled=False))
    sch = loop.scheduler
    rid = loop.submit_now(prompt=PROMPT, max_new_tokens=8, stop_ids=[])
    loop.step()
    [s] = sch._active
    need = pages_for(len(PROMPT) + 8 + CLOSING_SLACK, 4)
    assert s.pages_needed(4) == need and len(s.session.page_table) == need
    free = sch.pool.num_free_pages
    while sch._active:
        loop.step()
        if sch._active:
            assert sch.pool.num_free_pages == free
    assert sch.record(rid).finish_reason == "length"


def test_a_request_waits_visibly_for_pages(tiny_model):
    rows = 4
    per_request = pages_for(len(PROMPT) + 8 + CLOSING_SLACK, rows)
    loop = EngineLoop(tiny_model, SchedulerSettings(page_rows=rows, pool_pages=per_request + 3,
                                                  cache_enabled=False))
    sch = loop.scheduler
    a = loop.submit_now(prompt=PROMPT, max_new_tokens=8, stop_ids=[])
    b = loop.submit_now(prompt=PROMPT[::-1], max_new_tokens=8, stop_ids=[])
    loop.step()
    assert [s.id for s in sch._active] == [a] and sch.waiting_for_pages == b
    loop.run_until_done()
    assert sch.record(b).finish_reason == "length" and sch.waiting_for_pages is None
    sch.pool.check()


def test_ttft_and_queue_wait_count_from_arrival(tiny_model):
    loop = EngineLoop(tiny_model)
    sch = loop.scheduler
    arrival = time.perf_counter() - 5.0               # received 5 s ago, e.g. by an HTTP server
    rid = loop.submit_now(prompt=PROMPT, max_new_tokens=2, arrival=arrival, client="http 127.0.0.1 user=bob")
    loop.run_until_done()
    r = sch.record(rid)
    assert r.client == "http 127.0.0.1 user=bob"
    assert 5.0 <= r.queue_wait_s <= r.ttft_s
    now = loop.submit_now(prompt=PROMPT, max_new_tokens=2)
    loop.run_until_done()
    assert sch.record(now).ttft_s < 5.0 and sch.record(now).client == ""


def test_settings_change_live_and_pool_settings_are_refused(tiny_model):
    loop = EngineLoop(tiny_model, SchedulerSettings(max_streams=1, cache_pages=0))
    sch = loop.scheduler
    for i in range(3):
        loop.submit_now(prompt=PROMPT[i:], max_new_tokens=2)
    sch.update_settings(SchedulerSettings(max_streams=3, cache_pages=1))
    loop.step()
    assert len(sch._active) == 3 and sch.settings.max_streams == 3 and sch.cache.max_pages == 1
    with pytest.raises(ValueError, match="page_rows needs a new KV pool"):
        sch.update_settings(SchedulerSettings(page_rows=8))
    with pytest.raises(ValueError, match="max_streams"):
        sch.update_settings(SchedulerSettings(max_streams=0))
    assert sch.settings.max_streams == 3
    loop.run_until_done()


def test_a_refused_or_cancelled_turn_leaves_the_conversation_unchanged(tiny_model):
    loop = EngineLoop(tiny_model, SchedulerSettings(page_rows=4, pool_pages=30))
    sch = loop.scheduler
    loop.submit_now(system="s", user="first", conversation_id="c", max_new_tokens=2)
    loop.run_until_done()
    before = loop.chat.conversation("c")
    with pytest.raises(SubmitRefused, match="pool has only 30"):
        loop.submit_now(user="x" * 400, conversation_id="c", max_new_tokens=2)
    rid = loop.submit_now(user="second", conversation_id="c", max_new_tokens=50, stop_ids=[])
    with pytest.raises(SubmitRefused, match="still has a turn running"):
        loop.submit_now(user="third", conversation_id="c", max_new_tokens=2)
    loop.step()
    sch.cancel(rid)
    loop.run_until_done()
    assert sch.record(rid).finish_reason == "cancelled"
    assert loop.chat.conversation("c") is before
    loop.submit_now(user="second", conversation_id="c", max_new_tokens=2)
    loop.run_until_done()
    assert loop.chat.conversation("c").messages[:len(before.messages)] == before.messages
    assert len(loop.chat.conversation("c").messages) == len(before.messages) + 2
