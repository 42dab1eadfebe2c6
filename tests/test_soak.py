"""A long scheduler run on the tiny model: every request ends, the pool stays exact, memory stays flat."""

from __future__ import annotations

import gc

import numpy as np

from engine.loop import EngineLoop
from engine.sampler import SamplingParams
from engine.scheduler import FinishEvent, SchedulerSettings, SubmitRefused
from tests.loop_helpers import Heard

N_REQUESTS = 1000


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


def test_soak_thousand_requests(tiny_model):
    rng = np.random.default_rng(7)
    vocab = tiny_model.config.vocab_size
    prefixes = [rng.integers(0, vocab, n).tolist() for n in (8, 24, 40, 70)]
    loop = EngineLoop(tiny_model, SchedulerSettings(max_streams=6, max_queue=16, chunk_tokens=32, page_rows=4,
                                                  pool_pages=96, cache_pages=40))
    sch, heard = loop.scheduler, Heard(loop)
    sampling = SamplingParams(temperature=0.8, top_k=20, seed=3)
    submitted = finished = refused = 0
    reasons: dict[str, int] = {}
    rss_warm = None
    conversations: dict[str, int] = {}
    open_ids: list[int] = []
    while finished < N_REQUESTS:
        while submitted < N_REQUESTS and sch.queue_depth() < 8 and rng.random() < 0.7:
            try:
                if rng.random() < 0.15:
                    # Conversations of up to four turns, several open at once.
                    cid = f"conv{rng.integers(0, 3)}-{submitted // 120}"
                    rid = heard.submit(system="You are a tiny test model.",
                                          user="q" * int(rng.integers(1, 30)), conversation_id=cid,
                                          max_new_tokens=int(rng.integers(1, 12)), sampling=sampling)
                    conversations[cid] = conversations.get(cid, 0) + 1
                else:
                    prompt = prefixes[rng.integers(0, len(prefixes))] + \
                        rng.integers(0, vocab, int(rng.integers(1, 40))).tolist()
                    rid = heard.submit(prompt=prompt, max_new_tokens=int(rng.integers(1, 24)),
                                          sampling=sampling, stop_ids=[], namespace=str(rng.integers(0, 2)))
                open_ids.append(rid)
                submitted += 1
            except SubmitRefused as e:
                # A conversation whose last turn is still running refuses a new one: that is by design.
                assert "still has a turn running" in str(e)
                refused += 1
                break
        if open_ids and rng.random() < 0.05:
            sch.cancel(open_ids[int(rng.integers(0, len(open_ids)))])  # between steps, as the loop would
        for ev in heard.step():
            if isinstance(ev, FinishEvent):
                open_ids.remove(ev.request_id)
                finished += 1
                reasons[ev.reason] = reasons.get(ev.reason, 0) + 1
                assert ev.record.n_cached + ev.record.n_prefilled <= ev.record.n_prompt
        sch.pool.check()
        assert sch.pool.capacity == 96
        if rss_warm is None and finished >= 200:
            gc.collect()
            rss_warm = rss_bytes()
    assert not loop.has_work()
    assert sum(reasons.values()) == N_REQUESTS
    assert reasons.get("cancelled", 0) > 0 and reasons.get("length", 0) > 0
    assert sch.cache.counters.hits > 0 and sch.cache.counters.evicted_pages > 0
    assert len(sch.cache.pages) <= 40
    # Teardown: every page the sessions held came back; the cache holds the rest and can give it all back.
    assert sch.pool.num_used_pages == len(sch.cache.pages)
    sch.flush_cache()
    assert sch.pool.num_used_pages == 0
    gc.collect()
    assert rss_bytes() - rss_warm <= 50 * 1024 * 1024
