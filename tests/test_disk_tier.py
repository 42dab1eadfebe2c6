"""The disk tier under the pool (docs/design.md §12): evicted pages move to a memory-mapped
file, and an attach loads them back before the tail's prefill."""

from __future__ import annotations

import html

import numpy as np

import engine as dl
from engine.loop import EngineLoop
from engine.scheduler import Scheduler, SchedulerSettings

from .prefix_helpers import assert_cache_consistent, assert_session_sees, evaluated, make_pool, teardown


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def ask(loop: EngineLoop, **request) -> int:
    """One chat request through the engine loop, run to its end; its id."""
    rid = loop.submit_now(**request)
    loop.run_until_done()
    return rid


def test_evicted_pages_move_to_disk_and_come_back_with_their_kv():
    pool = make_pool(page_rows=4)
    cache = dl.create_prefix_cache(max_pages=2, disk_pages=8)
    events = []
    cache.add_listener(lambda e: events.append((e.kind, e.medium, [p.key for p in e.pages])))
    tokens = seq(100, 16)                                   # 4 pages; the budget keeps 2
    a = evaluated(pool, tokens)
    dl.prefix_insert(cache, pool, a, tokens, "system")
    a.release()
    assert len(cache.pages) == 2 and len(cache.tier) == 2 and cache.counters.demoted_pages == 2
    assert pool.num_used_pages == 2                        # the demoted pool pages were freed
    assert [(k, m) for k, m, _ in events] == [("stored", "GPU"), ("stored", "CPU"), ("stored", "CPU"),
                                              ("removed", "GPU")]
    events.clear()
    s = dl.Session(pool=pool)
    assert dl.prefix_attach(cache, pool, s, tokens + [1]) == 16    # 2 pages from the pool, 2 from disk
    assert_session_sees(s, tokens)                         # the loaded pages hold the very K/V
    assert cache.counters.disk_hit_pages == 2 and len(cache.tier) == 0
    assert [(k, m) for k, m, _ in events] == [("removed", "CPU"), ("stored", "GPU")]
    s.release()                                            # over budget again: two go down
    assert len(cache.pages) == 2 and len(cache.tier) == 2
    assert_cache_consistent(cache, pool)
    teardown([], cache, pool)
    assert len(cache.tier) == 0


def test_a_full_disk_tier_drops_its_oldest_page():
    pool = make_pool(page_rows=4)
    cache = dl.create_prefix_cache(max_pages=1, disk_pages=2)
    for start in (100, 200, 300):
        s = evaluated(pool, seq(start, 4))
        dl.prefix_insert(cache, pool, s, s.tokens)
        s.release()
    assert len(cache.pages) == 1 and len(cache.tier) == 2 and cache.tier.dropped == 0
    s = evaluated(pool, seq(400, 4))
    dl.prefix_insert(cache, pool, s, s.tokens)
    s.release()
    assert len(cache.tier) == 2 and cache.tier.dropped == 1
    miss = dl.Session(pool=pool)
    assert dl.prefix_attach(cache, pool, miss, seq(100, 5)) == 0      # the oldest is gone
    hit = dl.Session(pool=pool)
    assert dl.prefix_attach(cache, pool, hit, seq(300, 5)) == 4
    teardown([miss, hit], cache, pool)


def test_a_page_back_from_disk_gives_the_logits_of_never_evicting_it(tiny_model):
    m = tiny_model
    p1 = dl.encode(m, "The quick brown fox jumps over the lazy dog again and again")
    p2 = p1 + dl.encode(m, " and then it sleeps")

    def tail_logits(cache_pages: int, disk_pages: int):
        pool = dl.create_kv_pool(m, page_rows=4)
        cache = dl.create_prefix_cache(max_pages=cache_pages, disk_pages=disk_pages)
        a = dl.create_session(m, pool)
        dl.eval(m, a, p1)
        dl.prefix_insert(cache, pool, a, p1)
        dl.release_kv_pages(a)
        s = dl.create_session(m, pool)
        matched = dl.prefix_attach(cache, pool, s, p2)
        return matched, dl.eval(m, s, p2[matched:]), cache

    matched_ref, ref, _ = tail_logits(0, 0)
    matched, got, cache = tail_logits(1, 64)
    assert cache.counters.disk_hit_pages == len(p1) // 4 - 1 > 0
    assert matched == matched_ref == len(p1) // 4 * 4
    np.testing.assert_array_equal(got, ref)


def test_the_scheduler_hits_through_its_disk_tier(tiny_model):
    system = "You answer questions about paint. " * 4
    loop = EngineLoop(tiny_model, SchedulerSettings(page_rows=4, cache_pages=2, disk_tier_pages=256))
    sch = loop.scheduler
    first = ask(loop, system=system, user="Red?", max_new_tokens=2)
    second = ask(loop, system=system, user="Blue?", max_new_tokens=2)
    assert sch.record(first).n_cached == 0
    assert sch.record(second).n_cached > 2 * 4          # more than the pool's budget could hold
    assert sch.cache.counters.disk_hit_pages > 0 and sch.cache.tier.load_seconds > 0


def test_the_cache_panel_shows_the_disk_tier_and_its_load_time(tiny_model, qtbot):
    from engine.snapshot import SnapshotMaker
    from ui.cache_panel import CachePanel
    from ui.disk_tier_strip import TIER_COLOR
    system = "You answer questions about paint. " * 4
    loop = EngineLoop(tiny_model, SchedulerSettings(page_rows=4, cache_pages=2, disk_tier_pages=256))
    sch = loop.scheduler
    for user in ("Red?", "Blue?"):
        ask(loop, system=system, user=user, max_new_tokens=2)
    snap = SnapshotMaker().take(sch)
    assert snap.disk_capacity == 256 and snap.disk_pages == len(sch.cache.tier) > 0
    panel = CachePanel()
    qtbot.addWidget(panel)
    panel.update_snapshot(snap)
    text = panel.summary.text()
    assert f"{snap.disk_pages:,} / 256 pages" in text and "loaded back in" in text and "recompute" in text
    # the page's dtype and bytes
    assert "float32" in text and f"{snap.bytes_per_page / 1024:,.0f} KiB each" in text
    # the page map shows the tier: one cell per slot, the stored pages with their chain and text
    strip = panel.disk_tier
    assert not strip.isHidden() and strip.capacity == 256
    assert len(strip.pages) == len(snap.disk_tier) == len(sch.cache.tier)
    tp = next(iter(sch.cache.tier.pages.values()))
    tip = strip.tooltip_text(tp.slot)
    assert f"chain {tp.chain_id}" in tip and f"positions {tp.depth * 4}–{tp.depth * 4 + 3}" in tip
    assert html.escape(tiny_model.tokenizer.decode(list(tp.tokens))) in tip
    free = next(s for s in range(256) if s not in strip.pages)
    assert strip.tooltip_text(free).endswith("empty")
    middle = strip.cell_rect(tp.slot).center()
    assert strip.slot_at(middle.x(), middle.y()) == tp.slot
    assert strip.grab().toImage().pixelColor(middle).name() == TIER_COLOR
    panel.clear()
    assert strip.isHidden()
    # the hits chart counts hits by tier: the disk tier's under all of them
    from ui.charts import ChartsPanel
    charts = ChartsPanel()
    qtbot.addWidget(charts)
    charts.show()
    qtbot.waitExposed(charts)
    charts.set_data(snap.timeline, snap.records)
    charts.refresh()
    _, disk = charts.series("disk_hits")
    _, hits = charts.series("hits")
    assert disk[-1] == sch.cache.counters.disk_hits >= 1 and hits[-1] >= disk[-1]
    # the curve's whole data (getData() is what the view clips it to, which may lag a step)
    assert charts.curves["disk_hits"].getOriginalDataset()[1][-1] == disk[-1]


def test_the_page_storage_needs_a_new_scheduler(tiny_model):
    import dataclasses

    import pytest
    settings = SchedulerSettings(page_rows=4)
    sch = Scheduler(tiny_model, settings)
    for change in ({"kv_dtype": "float16"}, {"disk_tier_pages": 8}):
        with pytest.raises(ValueError, match="needs a new KV pool"):
            sch.update_settings(dataclasses.replace(settings, **change))


def test_a_watcher_sees_both_tiers_in_the_kv_events(tiny_model):
    from app.serve.kv_events_publisher import KVEventPublisher
    from app.watch.subscriber import Watcher
    pub = KVEventPublisher("tcp://127.0.0.1:*")
    watcher = Watcher([pub.endpoint])
    try:
        assert pub.wait_for_subscriber(10)
        loop = EngineLoop(tiny_model, SchedulerSettings(page_rows=4, cache_pages=3, disk_tier_pages=256))
        sch = loop.scheduler
        pub.attach(sch.cache)
        for user in ("Red?", "Blue?", "Green?"):
            ask(loop, system="You answer questions about paint. " * 4, user=user, max_new_tokens=2)
        assert pub.flush(10)
        state = watcher.states[0]
        want = {"GPU": set(sch.cache.pages), "CPU": set(sch.cache.tier.pages)}
        assert want["CPU"] and want["GPU"]

        def seen(medium):
            return set(state.tiers.get((medium, None), {}))
        for _ in range(200):
            watcher.poll(50)
            if seen("GPU") == want["GPU"] and seen("CPU") == want["CPU"]:
                break
        assert seen("GPU") == want["GPU"] and seen("CPU") == want["CPU"]
    finally:
        watcher.close()
        pub.close()
