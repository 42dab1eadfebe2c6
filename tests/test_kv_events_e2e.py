"""End to end, no mock: the real scheduler on the real model publishes its cache, a watcher rebuilds it."""

from __future__ import annotations

from app.serve.kv_events_publisher import KVEventPublisher
from app.watch.subscriber import Watcher
from engine import SamplingParams, prefix_held_groups, prefix_release
from engine.loop import EngineLoop
from engine.scheduler import SchedulerSettings
from tests.wait import wait_until

SYSTEM = ("You are the assistant of Bolt & Board, a neighbourhood hardware store. We sell power drills, "
          "hand saws, screws, nails, paint and ladders. Answer in one short sentence.")
QUESTIONS = ["Do you sell drills?", "Do you have green paint?", "Can I buy a ladder here?",
             "Are nails sold by weight?"]


def _caught_up(pub: KVEventPublisher, watcher: Watcher) -> None:
    assert pub.flush(10)
    state = watcher.states[0]
    wait_until(lambda: state.last_seq == pub.published_batches - 1, 10,
               lambda: f"the watcher to see every batch: {state.summary()}", step=lambda: watcher.poll(50))


def test_watcher_rebuilds_the_schedulers_cache_exactly(real_model):
    # A small cache budget: the four answers make the cache evict, so removals are exercised too.
    loop = EngineLoop(real_model, SchedulerSettings(max_streams=4, page_rows=16, cache_pages=6))
    sched = loop.scheduler
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*").attach(sched.cache)
    watcher = Watcher([pub.endpoint], [pub.replay_endpoint])
    try:
        assert pub.wait_for_subscriber(10)
        for q in QUESTIONS:
            loop.submit_now(system=SYSTEM, user=q, sampling=SamplingParams(temperature=0.0), max_new_tokens=6)
        loop.run_until_done()
        _caught_up(pub, watcher)
        state = watcher.states[0]
        cache = sched.cache
        assert state.block_hashes() == set(cache.pages) and state.live == prefix_held_groups(cache)
        assert state.counters.removed_blocks > 0            # the budget evicted, and the feed said so
        (tier,) = state.tiers.values()
        assert {h: b.parent for h, b in tier.items()} == {k: e.parent for k, e in cache.pages.items()}
        assert {h: b.tokens for h, b in tier.items()} == {k: e.tokens for k, e in cache.pages.items()}
        # the four prompts share the system prompt's pages: one tree holds them all
        assert max(c["blocks"] for c in state.chains()) >= 2
        c = state.counters
        assert (c.bad_frames, c.seq_gaps, c.unknown_removes, c.duplicate_stores) == (0, 0, 0, 0)

        assert sched.flush_cache() > 0                      # evictions: BlockRemoved
        _caught_up(pub, watcher)
        assert state.live == 0 == prefix_held_groups(cache) and c.removed_blocks == c.stored_blocks

        loop.submit_now(system=SYSTEM, user=QUESTIONS[0], sampling=SamplingParams(temperature=0.0),
                     max_new_tokens=2)
        loop.run_until_done()
        _caught_up(pub, watcher)
        assert state.live == prefix_held_groups(cache) > 0
        prefix_release(cache, sched.pool)                   # the whole cache at once: AllBlocksCleared
        _caught_up(pub, watcher)
        assert state.live == 0 and c.cleared == 1
    finally:
        watcher.close()
        pub.close()
