"""The scheduler on the bundled model: sharing, identical answers, conversations, cancel, backpressure."""

from __future__ import annotations

import pytest

from engine.loop import EngineLoop
from engine.metrics import PAGE_CACHED, PAGE_FREE, PAGE_PRIVATE, PAGE_SHARED
from engine.scheduler import FinishEvent, Scheduler, SchedulerSettings, SubmitRefused, TokenEvent
from tests.loop_helpers import Heard

SYSTEM = ("You are the assistant of Bolt & Board, a neighbourhood hardware store. We sell drills, saws, "
          "screws, paint and garden tools. We are open from 8am to 8pm. Answer briefly.")
QUESTIONS = ["Do you sell drills?", "When do you open?", "Do you have green paint?", "Can I buy a ladder?"]
MAX_NEW = 12


def run_all(heard: Heard, check_pool: bool = True) -> tuple[dict, list]:
    """Step the engine loop to the end; return finish records by id and every event."""
    loop = heard.loop
    sch = loop.scheduler
    done, events = {}, []
    while loop.has_work():
        for ev in heard.step():
            events.append(ev)
            if isinstance(ev, FinishEvent):
                done[ev.request_id] = ev.record
        if check_pool:
            sch.pool.check()
    return done, events


def submit_questions(heard: Heard, questions=QUESTIONS, **kw) -> list[int]:
    return [heard.submit(system=SYSTEM, user=q, max_new_tokens=MAX_NEW, **kw) for q in questions]


@pytest.fixture(scope="module")
def cached_run(real_model):
    loop = EngineLoop(real_model, SchedulerSettings(page_rows=16))
    heard = Heard(loop)
    sch = loop.scheduler
    ids = submit_questions(heard)
    done, events = run_all(heard)
    return sch, ids, done, events


def test_first_prompt_misses_and_the_others_hit(cached_run):
    sch, ids, done, _ = cached_run
    first, *rest = (done[i] for i in ids)
    assert first.n_cached == 0 and first.chain_hit is None
    system_pages = len(sch.model.tokenizer.encode(
        sch.model.tokenizer.render_chat([{"role": "system", "content": SYSTEM}], False))) // 16
    for r in rest:
        assert r.n_cached > 0 and r.n_cached % 16 == 0
        assert r.n_cached >= system_pages * 16
        assert r.chain_hit == first.chain_donated


def test_system_prompt_is_prefilled_once(cached_run):
    sch, ids, done, _ = cached_run
    # Prefix-aware admission: submitted together, the others waited for the first prompt's
    # pages instead of computing them, so the forward passes computed the system prompt once.
    tok = sch.model.tokenizer
    system = tok.encode(tok.render_chat([{"role": "system", "content": SYSTEM}], False))
    system_tokens = len(system) // 16 * 16
    assert system_tokens >= 32
    all_prompts = sum(done[i].n_prompt for i in ids)
    assert sch.prefill_computed <= all_prompts - (len(ids) - 1) * system_tokens
    assert sum(r.n_prefilled for r in done.values()) == sum(r.n_prompt - r.n_cached for r in done.values())
    assert sch.prefill_computed == sum(r.n_prefilled for r in done.values())
    assert sch.prefill_saved == sum(r.n_cached for r in done.values())
    assert all(r.queue_wait_s >= 0 for r in done.values())


def test_tokens_stream_before_the_finish(cached_run):
    _, ids, done, events = cached_run
    for rid in ids:
        pieces = [e.text for e in events if isinstance(e, TokenEvent) and e.request_id == rid]
        assert len(pieces) == done[rid].n_gen
        assert "".join(pieces) == done[rid].text
        finish_at = next(i for i, e in enumerate(events)
                         if isinstance(e, FinishEvent) and e.request_id == rid)
        assert all(i < finish_at for i, e in enumerate(events)
                   if isinstance(e, TokenEvent) and e.request_id == rid)


def test_greedy_answers_equal_with_cache_off_and_alone(real_model, cached_run):
    _, ids, done, _ = cached_run
    with_cache = [done[i].text for i in ids]
    loop = EngineLoop(real_model, SchedulerSettings(cache_enabled=False))
    heard = Heard(loop)
    off_ids = submit_questions(heard)
    off_done, _ = run_all(heard)
    assert [off_done[i].text for i in off_ids] == with_cache
    assert all(off_done[i].n_cached == 0 for i in off_ids)
    for q, expected in zip(QUESTIONS, with_cache):
        loop = EngineLoop(real_model, SchedulerSettings(max_streams=1))
        heard = Heard(loop)
        rid = heard.submit(system=SYSTEM, user=q, max_new_tokens=MAX_NEW)
        alone_done, _ = run_all(heard, check_pool=False)
        assert alone_done[rid].text == expected


def test_timeline_final_row_agrees_with_cache_and_pool(cached_run):
    sch, _, _, _ = cached_run
    row = sch.timeline.rows[-1]
    c = sch.cache.counters
    assert (row.queries, row.hits, row.hit_pages) == (c.queries, c.hits, c.hit_pages)
    assert row.cached_pages == len(sch.cache.pages) and row.chains == len(sch.cache.chains)
    assert row.capacity == sch.pool.capacity
    assert row.pages_free == sch.pool.num_free_pages
    assert row.pages_private + row.pages_shared + row.pages_cached == sch.pool.num_used_pages
    assert row.prefill_saved == c.tokens_saved
    assert row.active == 0 and row.queued == 0
    states = sch.page_states()
    assert (states == PAGE_PRIVATE).sum() == 0 and (states == PAGE_SHARED).sum() == 0
    assert (states == PAGE_CACHED).sum() == len(sch.cache.pages)
    assert (states == PAGE_FREE).sum() == sch.pool.num_free_pages
    assert len(sch.timeline) == row.step


def test_conversation_turn_two_hits_turn_one_with_its_answer(real_model):
    loop = EngineLoop(real_model)
    heard = Heard(loop)
    first = heard.submit(system=SYSTEM, user="I want to hang a shelf. What do I need?",
                            conversation_id="c",
                       max_new_tokens=20)
    done, _ = run_all(heard)
    t1 = done[first]
    second = heard.submit(user="Which drill?", conversation_id="c", max_new_tokens=8)
    done, _ = run_all(heard)
    t2 = done[second]
    turn_one_tokens = t1.n_prompt + t1.n_gen
    assert t2.n_cached > t1.n_prompt // 16 * 16, "turn 2 must reuse pages holding turn 1's answer"
    assert t2.n_cached >= turn_one_tokens // 16 * 16
    assert t2.chain_hit == t1.chain_donated
    history = real_model.tokenizer.decode(loop.chat.conversation("c").history_tokens)
    assert t1.text in history and "Which drill?" in history


def test_cancel_mid_stream_frees_its_pages_and_keeps_its_text(real_model):
    loop = EngineLoop(real_model)
    heard = Heard(loop)
    sch = loop.scheduler
    keep = heard.submit(system=SYSTEM, user=QUESTIONS[0], max_new_tokens=40)
    stop = heard.submit(system=SYSTEM, user=QUESTIONS[1], max_new_tokens=40)
    seen = 0
    while seen < 3:
        seen += sum(isinstance(e, TokenEvent) and e.request_id == stop for e in heard.step())
    assert sch.cancel(stop)
    events = heard.step()
    fin = [e for e in events if isinstance(e, FinishEvent) and e.request_id == stop]
    assert fin and fin[0].reason == "cancelled"
    assert fin[0].record.n_gen >= 3 and fin[0].record.text
    owners = [s.id for s in sch._active]
    assert stop not in owners and keep in owners
    # Only the surviving stream still holds pages privately; the cancelled one donated and released.
    held_by_sessions = {p for s in sch.streams() for p in s.session.page_table}
    private = set((sch.page_states() == PAGE_PRIVATE).nonzero()[0].tolist())
    assert private <= held_by_sessions
    done, _ = run_all(heard)
    assert done[keep].finish_reason == "length"
    assert sch.pool.num_used_pages == len(sch.cache.pages)


def test_cancel_a_queued_request(real_model):
    loop = EngineLoop(real_model, SchedulerSettings(max_streams=1))
    heard = Heard(loop)
    sch = loop.scheduler
    a, b = submit_questions(heard, QUESTIONS[:2])
    sch.cancel(b)
    done, _ = run_all(heard)
    assert done[b].finish_reason == "cancelled" and done[b].n_gen == 0
    assert done[a].finish_reason in ("stop", "length")


def test_full_queue_is_refused_with_a_reason(real_model):
    loop = EngineLoop(real_model, SchedulerSettings(max_queue=2))
    heard = Heard(loop)
    submit_questions(heard, QUESTIONS[:2])
    with pytest.raises(SubmitRefused, match="queue is full"):
        heard.submit(system=SYSTEM, user="one more", max_new_tokens=4)


def test_request_larger_than_the_pool_is_refused_at_submit(real_model):
    loop = EngineLoop(real_model, SchedulerSettings(page_rows=16, pool_pages=4))
    heard = Heard(loop)
    with pytest.raises(SubmitRefused, match="pool has only 4"):
        heard.submit(system=SYSTEM, user=QUESTIONS[0], max_new_tokens=64)


@pytest.mark.parametrize("cache_enabled", [False, True])
def test_bounded_pool_makes_admission_wait(real_model, cache_enabled):
    # Each request needs 5 pages of its own without the cache: a 14-page pool runs two at a time.
    loop = EngineLoop(real_model, SchedulerSettings(page_rows=16, pool_pages=14, max_streams=4,
                                                  cache_enabled=cache_enabled, cache_pages=6))
    heard = Heard(loop)
    sch = loop.scheduler
    ids = submit_questions(heard)
    most_active = 0
    while loop.has_work():
        loop.step()
        sch.pool.check()
        most_active = max(most_active, len(sch._active))
        assert len(sch.cache.pages) <= 6 or not sch.cache.pages
    if not cache_enabled:
        assert most_active == 2
    assert all(sch.record(i).finish_reason == "length" for i in ids)


def test_bad_settings_are_refused(real_model):
    for kw, name in (({"page_rows": 0}, "page_rows"), ({"max_streams": 0}, "max_streams"),
                     ({"cache_pages": -1}, "cache_pages"), ({"pool_pages": 0}, "pool_pages"),
                     ({"chunk_tokens": 0}, "chunk_tokens")):
        with pytest.raises(ValueError, match=name):
            Scheduler(real_model, SchedulerSettings(**kw))


def test_namespaces_do_not_share(real_model):
    loop = EngineLoop(real_model)
    heard = Heard(loop)
    sch = loop.scheduler
    a = heard.submit(system=SYSTEM, user=QUESTIONS[0], max_new_tokens=4, namespace="alice")
    run_all(heard)
    b = heard.submit(system=SYSTEM, user=QUESTIONS[1], max_new_tokens=4, namespace="bob")
    c = heard.submit(system=SYSTEM, user=QUESTIONS[2], max_new_tokens=4, namespace="alice")
    done, _ = run_all(heard)
    assert done[b].n_cached == 0
    assert done[c].n_cached > 0
    assert sch.record(a).chain_donated == done[c].chain_hit


def test_a_refused_turn_leaves_the_conversation_as_it_was(real_model):
    loop = EngineLoop(real_model, SchedulerSettings(page_rows=16, pool_pages=12))
    heard = Heard(loop)
    sch = loop.scheduler
    first = heard.submit(system=SYSTEM, user=QUESTIONS[0], conversation_id="c", max_new_tokens=8)
    done, _ = run_all(heard)
    messages = loop.chat.conversation("c").messages
    with pytest.raises(SubmitRefused, match="pool has only 12"):
        heard.submit(user="tell me everything " * 40, conversation_id="c", max_new_tokens=8)
    assert loop.chat.conversation("c").messages == messages
    second = heard.submit(user=QUESTIONS[1], conversation_id="c", max_new_tokens=4)
    done, _ = run_all(heard)
    assert done[second].n_cached > 0 and sch.record(first).finish_reason in ("stop", "length")
