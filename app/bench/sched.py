"""Bench section "Scheduler": the eight-question scenario with cache and batching vs without.

Both runs submit the same chat-template token prompts and generate exactly `new_tokens`
greedy tokens each (stop_ids=[]), so they do the same decode work and differ only in
prefix reuse and batching.
"""

from __future__ import annotations

import os
import time

import numpy as np

from engine.chat import chat_prompt, turn_messages
from engine.loop import EngineLoop
from engine.scheduler import SchedulerSettings

from ..scenario import SCENARIO_DIR, load_scenario
from .common import figure, ratio, target

FEATURE = "scheduler"  # the table's and the JSON's "feature" of its figures
SCENARIO = os.path.join(SCENARIO_DIR, "eight_questions.json")


def scenario_prompts(m, n_prompts: int | None = None,
                     system_sentences: int | None = None) -> tuple[list[list[int]], list[str], int]:
    """Token prompts of the eight-question scenario (system + each question, chat template);
    --quick keeps fewer questions and the system prompt's first sentences only."""
    sc = load_scenario(SCENARIO)
    tok = m.tokenizer
    questions = sc.prompts[:n_prompts] if n_prompts else sc.prompts
    system = sc.system
    if system_sentences:
        system = ". ".join(system.split(". ")[:system_sentences]) + "."
    prompts = [chat_prompt(tok, turn_messages(system, q)) for q in questions]
    return prompts, questions, sc.max_new_tokens


def run_scenario(m, prompts: list[list[int]], previews: list[str], new_tokens: int, **settings) -> dict:
    """Submit every prompt at once and step until done; wall time and every request record."""
    loop = EngineLoop(m, SchedulerSettings(**settings))
    sched = loop.scheduler
    t0 = time.perf_counter()
    for p, q in zip(prompts, previews, strict=True):
        loop.submit_now(prompt=p, max_new_tokens=new_tokens, stop_ids=[], preview=q)
    loop.run_until_done()
    wall = time.perf_counter() - t0
    records = [r.to_dict() for r in sched.records()]
    for r in records:
        r.pop("text", None)
    bad = [r for r in records if r["n_gen"] != new_tokens]
    if bad:
        raise RuntimeError(f"scheduler bench: request {bad[0]['id']} generated {bad[0]['n_gen']} tokens, "
                           f"expected {new_tokens}")
    hits = [r for r in records if r["n_cached"] > 0]
    misses = [r for r in records if r["n_cached"] == 0]
    waits = [r["queue_wait_s"] for r in records]

    by_batch: dict[int, list[float]] = {}
    for row in sched.timeline.rows:
        by_batch.setdefault(row.batch_size, []).append(row.step_s)

    def mean_ttft(rs):
        return float(np.mean([r["ttft_s"] for r in rs])) if rs else None

    return {
        "settings": sched.settings.to_dict(), "wall_s": wall, "steps": len(sched.timeline),
        "n_requests": len(records), "n_hits": len(hits), "n_misses": len(misses),
        "ttft_hit_mean_s": mean_ttft(hits), "ttft_miss_mean_s": mean_ttft(misses),
        "ttft_mean_s": mean_ttft(records),
        "queue_wait_mean_s": float(np.mean(waits)), "queue_wait_max_s": float(np.max(waits)),
        "prefill_computed": sched.prefill_computed, "prefill_saved": sched.prefill_saved,
        "decode_tokens": sched.decode_tokens,
        "steps_by_batch_tokens": {
            str(b): {"steps": len(t), "mean_s": float(np.mean(t)), "total_s": float(np.sum(t))}
            for b, t in sorted(by_batch.items())},
        "records": records,
    }


def ttft_alone(m, prompts: list[list[int]], reps: int) -> dict:
    """TTFT from arrival of a request arriving alone: on a cold cache (miss), then a different
    question on the same system prompt once that prefix is cached (hit); `reps` fresh schedulers."""
    miss_s, hit_s, cached = [], [], []
    for _ in range(reps + 1):  # the first pass only warms up (pages, first touch); not counted
        loop = EngineLoop(m, SchedulerSettings())
        sched = loop.scheduler
        recs = []
        for p in prompts[:2]:  # one after the other: each arrives to an idle scheduler
            rid = loop.submit_now(prompt=p, max_new_tokens=1, stop_ids=[])
            loop.run_until_done()
            recs.append(sched.record(rid))
        miss, hit = recs
        if miss.n_cached != 0 or hit.n_cached == 0:
            raise RuntimeError(f"scheduler bench: expected a miss then a hit, got n_cached "
                               f"{miss.n_cached} then {hit.n_cached}")
        miss_s.append(miss.ttft_s)
        hit_s.append(hit.ttft_s)
        cached.append(hit.n_cached)
    miss_s, hit_s = miss_s[1:], hit_s[1:]
    return {"miss_s": miss_s, "hit_s": hit_s, "hit_cached_tokens": cached[-1],
            "prompt_tokens": [len(p) for p in prompts[:2]],
            "miss_best_s": min(miss_s), "hit_best_s": min(hit_s),
            "miss_median_s": float(np.median(miss_s)), "hit_median_s": float(np.median(hit_s))}


def scheduler_figures(m, quick: bool) -> tuple[dict, dict]:
    prompts, previews, scenario_new = scenario_prompts(m, *((2, 3) if quick else (None, None)))
    new_tokens = 2 if quick else scenario_new
    configs = {"cached": {},  # Scheduler defaults: max_streams 8, cache on, speculative decoding off
               "plain": {"max_streams": 1, "cache_enabled": False},
               "spec": {"spec_enabled": True}}
    # one request alone: where speculative decoding could pay (drafts fill an otherwise 1-row pass)
    alone = {"one": {}, "one_spec": {"spec_enabled": True}}
    reps = 1 if quick else 2
    runs: dict[str, list[dict]] = {name: [] for name in {**configs, **alone}}
    for _ in range(reps):  # interleaved; each configuration keeps its fastest run
        for name, kw in configs.items():
            runs[name].append(run_scenario(m, prompts, previews, new_tokens, **kw))
        for name, kw in alone.items():
            runs[name].append(run_scenario(m, prompts[:1], previews[:1], new_tokens, **kw))
    best = {name: min(rs, key=lambda r: r["wall_s"]) for name, rs in runs.items()}
    cached, plain, spec = best["cached"], best["plain"], best["spec"]
    solo = ttft_alone(m, prompts, 1 if quick else 5)
    one, one_spec = best["one"], best["one_spec"]
    drafted = sum(r["spec_drafted"] for r in one_spec["records"])
    accepted = sum(r["spec_accepted"] for r in one_spec["records"])
    figures = {
        "sched_wall_cached_s": figure(cached["wall_s"], "s", FEATURE,
                                      note=f"{len(prompts)} requests x {new_tokens} tokens, "
                                           f"max_streams {cached['settings']['max_streams']}, cache on"),
        "sched_wall_plain_s": figure(plain["wall_s"], "s", FEATURE, note="max_streams 1, cache off"),
        "sched_wall_ratio": figure(ratio(cached["wall_s"], plain["wall_s"]), "ratio", FEATURE,
                                   **target("sched_wall_ratio"), note="cached+batched wall / plain wall"),
        # what a user feels from the cache: the same system prompt, each request arriving alone
        "ttft_alone_miss_s": figure(solo["miss_best_s"], "s", FEATURE,
                                    note=f"alone, cold cache, {solo['prompt_tokens'][0]} tokens; "
                                         f"best of {len(solo['miss_s'])}, TTFT from arrival"),
        "ttft_alone_hit_s": figure(solo["hit_best_s"], "s", FEATURE,
                                   note=f"alone, {solo['hit_cached_tokens']} of {solo['prompt_tokens'][1]} "
                                        f"tokens cached; best of {len(solo['hit_s'])}"),
        "ttft_hit_miss_ratio": figure(ratio(solo["hit_best_s"], solo["miss_best_s"]), "ratio", FEATURE,
                                      **target("ttft_hit_miss_ratio"), note="alone: hit TTFT / miss TTFT"),
        # diagnostic: in the eight-at-once run the hits also wait for the miss's prefill
        "burst_ttft_hit_mean_s": figure(cached["ttft_hit_mean_s"], "s", FEATURE,
                                        note=f"{cached['n_hits']} hits, all submitted at once, from arrival"),
        "burst_ttft_miss_mean_s": figure(cached["ttft_miss_mean_s"], "s", FEATURE,
                                         note=f"{cached['n_misses']} misses, all submitted at once"),
        "queue_wait_mean_s": figure(cached["queue_wait_mean_s"], "s", FEATURE, note="cached run"),
        "queue_wait_max_s": figure(cached["queue_wait_max_s"], "s", FEATURE, note="cached run"),
        "plain_queue_wait_mean_s": figure(plain["queue_wait_mean_s"], "s", FEATURE, note="plain run"),
        "sched_wall_spec_s": figure(spec["wall_s"], "s", FEATURE,
                                    note="defaults with speculative decoding on"),
        "spec_speedup_one_stream": figure(
            ratio(one["wall_s"], one_spec["wall_s"]), "x", FEATURE,
            note=f"one request, {new_tokens} tokens: wall without / with speculative decoding"),
        "spec_acceptance": figure(ratio(accepted, drafted), "ratio", FEATURE,
                                  note=f"one request: {accepted} of {drafted} drafted tokens accepted"),
    }
    details = {"scenario": SCENARIO, "new_tokens": new_tokens, "prompt_tokens": [len(p) for p in prompts],
               "submitted_as": "chat-template token prompts, all at once, greedy, stop_ids=[]",
               "reps": reps, "all_wall_s": {name: [r["wall_s"] for r in rs] for name, rs in runs.items()},
               "ttft_alone": solo, "cached": cached, "plain": plain, "spec": spec, "one": one,
               "one_spec": one_spec}
    return figures, details
