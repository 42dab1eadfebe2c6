"""Speculative decoding from the prompt: n-gram drafts, verification, equal to plain decoding."""

from __future__ import annotations

import json

import numpy as np
import pytest

import engine as dl
from app.cli import main
from engine.sampler import Sampler, SamplingParams
from engine.spec import propose, verify


def test_propose_takes_what_followed_the_latest_longest_match():
    #            0  1  2  3  4  5  6  7  8  9
    history = [5, 6, 7, 8, 9, 5, 6, 7, 1, 5, 6, 7]
    # suffix [5, 6, 7] occurred at 0 (then 8 9) and at 5 (then 1 5): the latest wins
    assert propose(history, 3) == [1, 5, 6]
    assert propose(history, 1) == [1]
    assert propose([1, 2, 3, 4], 3) == []                   # nothing repeats
    assert propose([4, 9, 4], 2) == [9, 4]                  # a 1-gram when longer ones miss
    assert propose(history, 0) == [] and propose([], 3) == [] and propose([7], 3) == []


def test_verify_keeps_agreed_drafts_and_the_first_correction():
    vocab = 10
    logits = np.zeros((4, vocab), dtype=np.float32)
    for row, best in enumerate([3, 4, 7, 2]):
        logits[row, best] = 5.0
    greedy = Sampler(SamplingParams(temperature=0.0))
    assert verify(greedy, [1], [3, 4, 5], logits) == [3, 4, 7]     # the third draft was wrong
    assert verify(greedy, [1], [3, 4, 7], logits) == [3, 4, 7, 2]  # all agreed: one bonus token
    assert verify(greedy, [1], [9], logits[:2]) == [3]
    assert verify(greedy, [1], [], logits[:1]) == [3]


def test_n_logits_rows_equal_all_positions(tiny_model):
    m = tiny_model
    ids = dl.encode(m, "<|im_start|>user\nSay the wind, the wind, the wind.<|im_end|>\n")
    pool = dl.create_kv_pool(m, page_rows=8)
    a, b = dl.create_session(m, pool), dl.create_session(m, pool)
    want_a = dl.eval_batch(m, [a], [ids[:12]], all_positions=True)
    want_b = dl.eval_batch(m, [b], [ids[:5]], all_positions=True)
    pool2 = dl.create_kv_pool(m, page_rows=8)
    a2, b2 = dl.create_session(m, pool2), dl.create_session(m, pool2)
    got = dl.eval_batch(m, [a2, b2], [ids[:12], ids[:5]], n_logits=[3, 1])
    assert got.shape == (4, m.config.vocab_size)
    np.testing.assert_allclose(got[:3], want_a[-3:], rtol=1e-5, atol=1e-5 * np.abs(want_a).max())
    np.testing.assert_allclose(got[3], want_b[-1], rtol=1e-5, atol=1e-5 * np.abs(want_b).max())
    with pytest.raises(ValueError, match="n_logits"):
        dl.eval_batch(m, [a2], [ids[12:14]], n_logits=[3])
    assert a2.n_past == 12 and pool2.num_used_pages == 3   # the refused call allocated nothing


def run_scheduler(m, prompts, spec: bool, k: int = 4, max_new: int = 24):
    from engine.loop import EngineLoop
    from engine.scheduler import SchedulerSettings
    from tests.loop_helpers import Heard
    loop = EngineLoop(m, SchedulerSettings(max_streams=4, spec_enabled=spec, spec_k=k))
    sch, heard = loop.scheduler, Heard(loop)
    ids = [heard.submit(prompt=p, max_new_tokens=max_new, stop_ids=[]) for p in prompts]
    texts: dict[int, list[int]] = {i: [] for i in ids}
    steps = 0
    while loop.has_work():
        for ev in heard.step():
            if hasattr(ev, "token_id"):
                texts[ev.request_id].append(ev.token_id)
        steps += 1
    sch.pool.check()
    assert sch.pool.num_used_pages == len(sch.cache.pages)   # every session released
    return [texts[i] for i in ids], [sch.record(i) for i in ids], steps


def test_scheduler_spec_decoding_equals_plain_greedy_in_fewer_steps(tiny_model):
    m = tiny_model
    base = dl.encode(m, "<|im_start|>user\\nthe wind the wind the wind the wind<|im_end|>\\n")
    prompts = [base + [5 + i] for i in range(3)]
    plain, _, plain_steps = run_scheduler(m, prompts, spec=False)
    spec, records, spec_steps = run_scheduler(m, prompts, spec=True)
    assert spec == plain, "speculative decoding changed greedy output"
    drafted = sum(r.spec_drafted for r in records)
    accepted = sum(r.spec_accepted for r in records)
    assert drafted > 0 and accepted > 0
    assert all(r.spec_acceptance == r.spec_accepted / r.spec_drafted for r in records if r.spec_drafted)
    assert spec_steps < plain_steps
    assert all(r.n_gen == 24 for r in records)


def test_rollback_forgets_rejected_tokens_and_never_touches_a_shared_page(tiny_model):
    m = tiny_model
    ids = dl.encode(m, "<|im_start|>user\nthe wind the wind the wind the wind<|im_end|>\n")
    pool = dl.create_kv_pool(m, page_rows=8)
    s = dl.create_session(m, pool)
    dl.eval(m, s, ids[:16])
    pages = s.page_table
    dl.eval(m, s, ids[16:20])                      # four "drafts"
    pool.rollback(s, 3)
    assert s.n_past == 17 and s.tokens == ids[:17] and s.page_table[:2] == pages
    # the forgotten rows are simply overwritten: the next eval equals a fresh session's
    fresh = dl.create_session(m, dl.create_kv_pool(m, page_rows=8))
    np.testing.assert_allclose(dl.eval(m, s, ids[17:19]), dl.eval(m, fresh, ids[:19]),
                               rtol=1e-5, atol=1e-5 * 10)
    with pytest.raises(ValueError, match="cannot roll back"):
        pool.rollback(s, 20)
    cache = dl.create_prefix_cache()
    dl.prefix_insert(cache, pool, s, ids[:16])     # pages 0-1 now shared with the cache
    with pytest.raises(RuntimeError, match="shared or cached page"):
        pool.rollback(s, 5)
    assert s.n_past == 19
    dl.release_kv_pages(s)
    dl.prefix_release(cache, pool)
    pool.check()


@pytest.mark.parametrize("flags, on, k", [([], False, 4), (["--spec", "--spec-k", "3"], True, 3),
                                          (["--spec", "--no-spec"], False, 4)])
def test_run_spec_options_reach_the_scheduler_and_the_report(tiny_gguf_path, tmp_path, flags, on, k):
    out = tmp_path / "run.json"
    assert main(["run", "--model", tiny_gguf_path, "--system", "the wind the wind the wind the wind",
                 "--prompt", "the wind the wind the wind", "--max-new", "16", "--temp", "0", "--quiet",
                 "--json", str(out), *flags]) == 0
    rep = json.loads(out.read_text("utf-8"))
    assert (rep["settings"]["spec_enabled"], rep["settings"]["spec_k"]) == (on, k)
    drafted = sum(r["spec_drafted"] for r in rep["requests"])
    assert rep["totals"]["spec_drafted"] == drafted and (drafted > 0) == on


def test_run_refuses_a_bad_spec_k(tiny_gguf_path):
    with pytest.raises(SystemExit, match="spec_k"):
        main(["run", "--model", tiny_gguf_path, "--prompt", "hi", "--spec", "--spec-k", "0"])
