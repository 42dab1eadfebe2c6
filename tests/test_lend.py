"""Requests that share a prefix another request is computing join the pass that writes it."""

from __future__ import annotations

from engine.loop import EngineLoop
from engine.scheduler import FinishEvent, SchedulerSettings, TokenEvent
from tests.loop_helpers import Heard

SHARED = list(range(1000, 1064))            # 4 pages of 16, uncached at the start
OWNER = SHARED + [5, 6, 7, 8]
HITS = [SHARED + [9, 10, 11], SHARED + [12, 13]]
MAX_NEW = 6


def answers(loop: EngineLoop, prompts: list[list[int]], between=None) -> tuple[list, list, list[int]]:
    """Submit together, step to the end (checking the pool), return each greedy answer, each
    step's events and the request ids; `between(step_no, ids)` runs after every step."""
    heard = Heard(loop)
    ids = [heard.submit(prompt=p, max_new_tokens=MAX_NEW, stop_ids=[]) for p in prompts]
    tokens = {i: [] for i in ids}
    steps = []
    while loop.has_work():
        events = heard.step()
        steps.append(events)
        loop.scheduler.pool.check()
        for ev in events:
            if isinstance(ev, TokenEvent):
                tokens[ev.request_id].append(ev.token_id)
        if between:
            between(len(steps), ids)
    return [tokens[i] for i in ids], steps, ids


def alone(model, prompt: list[int]) -> list[int]:
    loop = EngineLoop(model, SchedulerSettings(page_rows=16, cache_enabled=False))
    return answers(loop, [prompt])[0][0]


def test_hits_join_the_owners_prefill_pass_and_answer_as_if_alone(real_model):
    loop = EngineLoop(real_model, SchedulerSettings(page_rows=16))
    sch = loop.scheduler
    got, steps, ids = answers(loop, [OWNER, *HITS])
    # one pass computed the owner's prompt and only the hits' own tails, and all three got a first token
    first = sch.timeline.rows[0]
    assert first.prefill_computed == len(OWNER) + sum(len(h) - len(SHARED) for h in HITS)
    assert {ev.request_id for ev in steps[0] if isinstance(ev, TokenEvent)} == set(ids)
    assert got == [alone(real_model, p) for p in (OWNER, *HITS)]
    # counted as the cache hits they would have been had they waited
    recs = [sch.record(i) for i in ids]
    assert [r.n_cached for r in recs] == [0, len(SHARED), len(SHARED)]
    assert all(r.chain_hit == recs[0].chain_donated is not None for r in recs[1:])
    assert sch.cache.counters.hits == 2 and sch.cache.counters.tokens_saved == 2 * len(SHARED)
    assert sch.prefill_saved == 2 * len(SHARED)


def test_a_borrower_whose_owner_leaves_first_starts_over(real_model):
    """A short prompt takes most of a 64-token chunk, so the owner's piece stops short of the
    lent pages; the owner is then cancelled: its borrower starts over and still answers right,
    and no unwritten page ever reaches the cache."""
    loop = EngineLoop(real_model, SchedulerSettings(page_rows=16, chunk_tokens=64))
    sch = loop.scheduler
    other = list(range(2000, 2040))

    def cancel_owner(step_no, ids):
        if step_no == 1:
            assert sch.record(ids[2]).n_cached == len(SHARED)  # borrowed, not yet written
            sch.cancel(ids[1])  # between steps, on the owner thread: as the loop's cancel does

    got, steps, ids = answers(loop, [other, OWNER, HITS[0]], between=cancel_owner)
    finished = {ev.request_id: ev.record for s in steps for ev in s if isinstance(ev, FinishEvent)}
    assert finished[ids[1]].finish_reason == "cancelled"
    assert got[0] == alone(real_model, other) and got[2] == alone(real_model, HITS[0])
    # the cache holds only written pages: a later request reusing them answers as if alone
    again, _, _ = answers(loop, [SHARED + [9, 10, 11]])
    assert again[0] == alone(real_model, HITS[0])
