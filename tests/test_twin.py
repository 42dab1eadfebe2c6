"""The twin (docs/design.md §16): the engine's scheduler over storage-free pages on a step-cost
clock. Deterministic: a given cost file, no timing."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os

import pytest

from app.replay.calibrate import compare as compare_fits
from app.replay.calibrate import comparison_report, report
from app.replay.stepcost import (
    TERMS,
    PassTimes,
    StepCost,
    StepShape,
    features,
    fit,
    prompt_shape,
    shape_from_parts,
)
from app.replay.trace import TraceHeader, TraceRequest, open_trace, write_trace
from app.replay.twin_replay import TwinConfig, predict, predict_draws
from engine.sampler import SamplingParams
from engine.scheduler import Request, Scheduler, SchedulerSettings

# Costs in binary fractions, so the hand-worked times are exact: a pass costs 1 s, plus 1/8 s
# per prefill row and 1/2 s per decode row.
COST = StepCost(c0=1.0, c_prefill=0.125, c_decode=0.5)
SETTINGS = SchedulerSettings(page_rows=4, chunk_tokens=16, max_streams=2)
SYSTEM = list(range(40, 48))   # two pages every prompt but C's starts with


def _small_trace() -> list[TraceRequest]:
    """A, B and C arrive together (B shares A's first two pages, C nothing), D later (shares them)."""
    def req(t, prompt, out):
        return TraceRequest(arrival_s=t, input_length=len(prompt), output_length=out, prompt=prompt)
    return [req(0.0, SYSTEM + [60, 61, 62, 63], 2),     # A
            req(0.0, SYSTEM + [70, 71, 72, 73], 1),     # B
            req(0.0, [80, 81, 82, 83], 2),              # C
            req(10.0, SYSTEM + [90, 91, 92, 93], 1)]    # D


def _write(tmp_path, requests, name="t.jsonl", rows=4):
    path = str(tmp_path / name)
    write_trace(path, TraceHeader(page_rows=rows), requests)
    return open_trace(path)


def test_the_predicted_timeline_is_the_one_worked_out_by_hand(tmp_path):
    """Pass 1 (t 0-3): A admitted, B borrows A's two shared pages as A computes them and joins the
    pass: 12 + 4 prefill rows = 1 + 16/8 = 3 s; both first tokens at 3, B (one token) ends.
    C waited for a stream (max 2). Pass 2 (3-5): C admitted, its 4 rows + A's decode row = 1 + 0.5 +
    0.5 = 2 s; A ends, C's first token. Pass 3 (5-6.5): C decodes, ends. D arrives at 10 at an idle
    replica, attaches the two cached pages, prefills 4 rows: 1.5 s."""
    done = []
    res = predict(_write(tmp_path, _small_trace()), TwinConfig(COST, SETTINGS), per_request=done.append)
    got = {p.index: (p.admitted_s, p.first_token_s, p.end_s, p.cached_tokens) for p in done}
    assert got == {0: (0.0, 3.0, 5.0, 0), 1: (0.0, 3.0, 3.0, 8), 2: (3.0, 5.0, 6.5, 0),
                   3: (10.0, 11.5, 11.5, 8)}
    assert [p.index for p in done] == [1, 0, 2, 3]       # finish order
    by = {p.index: p for p in done}
    assert (by[2].queue_s, by[2].ttft_s, by[2].tpot_s) == (3.0, 5.0, 1.5)
    assert by[0].tpot_s == 2.0
    assert res.steps == 4
    assert res.ttft_s["p50"] == pytest.approx(3.0)
    assert res.token_hit_ratio == pytest.approx(16 / 40)


def test_a_hit_right_after_an_idle_moment_costs_its_term_and_only_then(tmp_path):
    """`c_hit_after_idle` at 1/2 s on the hand-worked timeline: pass 1 (0-3.5) is the idle
    replica's first and B's piece starts after A's two pages: 3 + 1/2 s. Passes 2 and 3 run back
    to back (3.5-5.5, 5.5-7). D at 10 hits the cached pages of an idle replica: 1.5 + 1/2 s. D at
    7 + 1/16 comes too soon after pass 3 for an idle moment (stepcost.IDLE_GAP_S): 1.5 s. C alone
    prefills no cached page after its idle moment: 1 + 4/8 s, then its decode pass."""
    from app.replay.stepcost import IDLE_GAP_S
    assert 1 / 16 < IDLE_GAP_S < 3
    cost = dataclasses.replace(COST, c_hit_after_idle=0.5)

    def timeline(requests, name):
        done = []
        predict(_write(tmp_path, requests, name), TwinConfig(cost, SETTINGS), per_request=done.append)
        return {p.index: (p.admitted_s, p.first_token_s, p.end_s) for p in done}
    assert timeline(_small_trace(), "a.jsonl") == {0: (0.0, 3.5, 5.5), 1: (0.0, 3.5, 3.5),
                                                   2: (3.5, 5.5, 7.0), 3: (10.0, 12.0, 12.0)}
    soon = _small_trace()
    soon[3] = dataclasses.replace(soon[3], arrival_s=7.0625)
    assert timeline(soon, "b.jsonl")[3] == (7.0625, 8.5625, 8.5625)
    assert timeline([_small_trace()[2]], "c.jsonl") == {0: (0.0, 1.5, 3.0)}


def test_the_real_scheduler_admits_and_finishes_in_the_twins_order(tiny_model, tmp_path):
    """The same requests through the real Scheduler and the tiny model: the same pass admits each
    and the same pass finishes each (D submitted when the others are done, as it arrives)."""
    done = []
    predict(_write(tmp_path, _small_trace()), TwinConfig(COST, SETTINGS), per_request=done.append)
    twin_pass = {p.index: ([0.0, 3.0, 5.0, 10.0].index(p.admitted_s),
                           [3.0, 5.0, 6.5, 11.5].index(p.end_s)) for p in done}
    sched = Scheduler(tiny_model, SETTINGS)
    trace = _small_trace()
    ids = {}
    admitted, finished = {}, {}
    def run(passes):
        for k in passes:
            sched.step()
            queued = {rid for rid, _, _ in sched.queued()}
            for i, rid in ids.items():
                if rid not in queued:
                    admitted.setdefault(i, k)
                rec = sched.record(rid)
                if rec.finish_reason is not None:
                    finished.setdefault(i, k)
    for i, r in enumerate(trace[:3]):
        ids[i] = sched.submit(Request(r.prompt, SamplingParams(), max_new_tokens=r.output_length,
                                      stop_ids=[]))
    run(range(3))
    assert not sched.has_work()
    ids[3] = sched.submit(Request(trace[3].prompt, SamplingParams(), max_new_tokens=1, stop_ids=[]))
    run([3])
    real = {i: (admitted[i], finished[i]) for i in ids}
    assert real == twin_pass
    assert [sched.record(ids[i]).n_cached for i in range(4)] == [0, 8, 0, 8]


def _burst_trace(rate: float, n: int = 24) -> list[TraceRequest]:
    """n requests sharing a 32-token system prompt, `rate` per second."""
    return [TraceRequest(arrival_s=i / rate, input_length=48, output_length=8,
                         prompt=list(range(100, 132)) + [200 + 16 * i + j for j in range(16)])
            for i in range(n)]


def test_goodput_follows_the_rate_until_the_replica_is_full_then_falls(tmp_path):
    """A pass of 1/20 s + 1/50 s per decode row: four streams of eight tokens serve about three
    requests a second. Below that, doubling the rate doubles the goodput (every request meets the
    0.3 s TTFT target); past it, each doubling queues more and fewer requests meet it."""
    cost = StepCost(c0=0.05, c_prefill=0.002, c_decode=0.02)
    config = TwinConfig(cost, SchedulerSettings(page_rows=16, max_streams=4), slo_ttft_s=0.3)
    res = {rate: predict(_write(tmp_path, _burst_trace(rate), f"r{rate}.jsonl", 16), config)
           for rate in (1.0, 2.0, 4.0, 8.0)}
    assert [r.requests for r in res.values()] == [24] * 4
    assert res[1.0].good == res[2.0].good == 24
    assert res[2.0].goodput_rps > 1.8 * res[1.0].goodput_rps
    assert res[8.0].good < res[4.0].good < res[2.0].good
    assert res[8.0].goodput_rps < res[4.0].goodput_rps < res[2.0].goodput_rps
    assert res[8.0].ttft_s["p90"] > res[4.0].ttft_s["p90"] > res[2.0].ttft_s["p90"]
    strict = predict(_write(tmp_path, _burst_trace(1.0), "strict.jsonl", 16),
                     TwinConfig(cost, config.settings, slo_ttft_s=0.3, slo_tpot_s=0.01))
    assert strict.good == 0       # no pass is that short: every request misses the TPOT target


def test_fit_recovers_the_coefficients_it_was_given():
    true = StepCost(c0=0.02, c_prefill=0.001, c_decode=0.004, c_ctx=2e-6, c_prefill_ctx=1e-7)
    shapes = [StepShape(p, d, d * ctx, p * (p + 1) // 2 + p * ctx)
              for p, d, ctx in itertools.product((0, 16, 128, 512), (0, 1, 4, 8), (0, 100, 1000))
              if p or d]
    got = fit(shapes, [true.predict(s) for s in shapes], machine="test")
    for name in ("c0", "c_prefill", "c_decode", "c_ctx", "c_prefill_ctx"):
        assert getattr(got, name) == pytest.approx(getattr(true, name), rel=1e-6)
    assert got.fit["max_rel_error"] < 1e-9 and got.machine == "test"


def test_a_cost_file_round_trips_and_bad_ones_say_what_is_wrong(tmp_path):
    path = str(tmp_path / "cost.json")
    COST.save(path)
    assert StepCost.load(path) == COST
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "prefixlab-step-cost", "version": 1, "c0": -1}))
    with pytest.raises(ValueError, match="c0 must be a finite number >= 0"):
        StepCost.load(str(bad))
    bad.write_text(json.dumps({"format": "prefixlab-step-cost", "version": 10, "c0": 1}))
    with pytest.raises(ValueError, match="version 10"):
        StepCost.load(str(bad))
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a step-cost file"):
        StepCost.load(str(bad))


def test_a_fit_keeps_its_standard_errors_and_a_version_1_file_still_reads(tmp_path):
    """Version 2 adds each coefficient's standard error; a hand-written version 1 file has none."""
    true = StepCost(c0=0.02, c_prefill=0.001, c_decode=0.004)
    shapes = [StepShape(p, d) for p, d in itertools.product((0, 16, 128), (0, 1, 4, 8)) if p or d]
    # each shape timed three times: once fast, once right, once slowed (another process took a
    # core), a pass holding prompt rows slowed more (its GEMM waits for the slowest core)
    def extras(s):
        return (-0.01, 0.0, 0.2) if s.prefill_rows else (-0.002, 0.0, 0.05)
    times = [true.predict(s) + e for s in shapes for e in extras(s)]
    got = fit([s for s in shapes for _ in range(3)], times, machine="test")
    assert got.c0 == pytest.approx(0.02, rel=1e-9) and got.c_decode == pytest.approx(0.004, rel=1e-9)
    assert (got.fit["steps"], got.fit["shapes"]) == (33, 11)      # the median of each shape's three
    assert set(got.stderr) == set(TERMS)
    # the extras: each pass's seconds over its shape's median, each a third of the time, by kind
    for extra, (low, high) in ((got.extra_s, (-0.002, 0.05)), (got.extra_prompt_s, (-0.01, 0.2))):
        assert min(extra) == pytest.approx(low) and max(extra) == pytest.approx(high)
        assert sorted(extra) == list(extra) and sum(abs(e) < 1e-12 for e in extra) >= 6
    assert got.spread == got.spread_prompt == ()
    path = str(tmp_path / "cost.json")
    got.save(path)
    on_disk = json.loads(open(path).read())
    assert (on_disk["format"], on_disk["version"]) == ("prefixlab-step-cost", 9)
    assert StepCost.load(path) == got and len(got.covariance) == len(TERMS)
    assert got.fit["stderr_from"] == "residuals"   # no runs given: the residuals' own
    assert got.stderr["c0"] ** 2 == pytest.approx(got.covariance[0][0])
    v8 = tmp_path / "v8.json"   # version 8's errors left the rounds' levels out: read as they are
    v8.write_text(json.dumps({**on_disk, "version": 8, "fit": {"stderr_from": "runs resampled"}}))
    assert StepCost.load(str(v8)).covariance == got.covariance
    v7 = tmp_path / "v7.json"   # version 7 kept no covariance: the terms taken as independent
    v7.write_text(json.dumps({"format": "prefixlab-step-cost", "version": 7, "c0": 0.5,
                              "stderr": {"c0": 0.01}}))
    assert StepCost.load(str(v7)).covariance == ()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "prefixlab-step-cost", "version": 8, "c0": 0.5,
                               "covariance": [[1]]}))
    with pytest.raises(ValueError, match="covariance must be 8 rows of 8"):
        StepCost.load(str(bad))
    v3 = tmp_path / "v3.json"   # version 3 kept one spread for every pass: prompt passes draw from it
    v3.write_text(json.dumps({"format": "prefixlab-step-cost", "version": 3, "c0": 0.5, "spread": [2.0]}))
    assert PassTimes(StepCost.load(str(v3)))(prompt_shape(0, 8)) == pytest.approx(1.0)
    v5 = tmp_path / "v5.json"   # version 5's spreads are factors, drawn as factors, in its chain
    v5.write_text(json.dumps({"format": "prefixlab-step-cost", "version": 5, "c0": 0.5, "spread": [2.0],
                              "spread_prompt": [3.0], "rho": 0.4}))
    five = StepCost.load(str(v5))
    assert five.rho == 0.4 and PassTimes(five)(prompt_shape(0, 8)) == pytest.approx(1.5)
    v6 = tmp_path / "v6.json"   # version 6 had no c_hit_after_idle: such a pass costs nothing more
    v6.write_text(json.dumps({"format": "prefixlab-step-cost", "version": 6, "c0": 0.5, "c_prompt": 0.25}))
    idle_hit = StepShape(prefill_rows=4, prefill_context=4 * 8 + 10, pieces=((8, 4),), hit_after_idle=True)
    assert StepCost.load(str(v6)).predict(idle_hit) == pytest.approx(0.75)
    old = tmp_path / "v1.json"
    old.write_text(json.dumps({"format": "prefixlab-step-cost", "version": 1, "c0": 0.5, "c_decode": 0.1}))
    assert StepCost.load(str(old)) == StepCost(c0=0.5, c_decode=0.1)


def test_a_prompt_pass_is_padded_and_its_attention_tiled_as_the_engine_runs_it(tmp_path):
    """Worked by hand for an engine that pads a prompt pass to 28 rows and attends in tiles of 32
    queries x 128 keys (stepcost.features): the terms c0, c_prompt, c_prefill, c_decode, c_ctx,
    c_prefill_ctx, c_after_prompt."""
    hit = StepShape(prefill_rows=5, decode_rows=2, decode_context=2 * 300,
                    prefill_context=5 * 128 + 15, pieces=((128, 5),))   # 5 rows on a cached 128
    # 28 rows padded, the 2 decode rows among them; 1 x 2 tiles: 32 queries x 256 keys
    assert features(hit, 28, (32, 128)) == [1, 1, 26, 2, 600, 32 * 256, 0, 0]
    # without padding or tiles (another engine; a version 2 file): rows as they are, causal pairs
    assert features(hit, 0, None) == [1, 1, 5, 2, 600, 5 * 128 + 15, 0, 0]
    fresh = prompt_shape(0, 40)                                          # 2 x 1 tiles
    assert features(fresh, 28, (32, 128)) == [1, 1, 40, 0, 0, 64 * 128, 0, 0]
    decode = StepShape(decode_rows=3, decode_context=600, after_prompt=True)
    assert features(decode, 28, (32, 128)) == [1, 0, 0, 3, 600, 0, 1, 0]
    # the same hit right after an idle moment (shape_from_parts: a piece after cached positions)
    idle_hit = shape_from_parts([(299, 1)] * 2, [(128, 5)], after_idle=True)
    assert features(idle_hit, 28, (32, 128)) == [1, 1, 26, 2, 600, 32 * 256, 0, 1]
    assert not shape_from_parts([], [(0, 40)], after_idle=True).hit_after_idle   # nothing cached
    cost = StepCost(c0=0.01, c_prompt=0.05, c_prefill=0.001, c_decode=0.002, c_prefill_ctx=1e-6,
                    c_after_prompt=0.015, prompt_pad_rows=28, attention_tile=(32, 128))
    assert cost.predict(hit) == pytest.approx(0.01 + 0.05 + 0.026 + 0.004 + 32 * 256e-6)
    assert cost.predict(decode) == pytest.approx(0.01 + 0.006 + 0.015)
    path = str(tmp_path / "cost.json")
    cost.save(path)
    assert StepCost.load(path) == cost and StepCost.load(path).attention_tile == (32, 128)
    v2 = tmp_path / "v2.json"   # a version 2 file: no padding, no tiles, no prompt-pass terms
    v2.write_text(json.dumps({"format": "prefixlab-step-cost", "version": 2, "c0": 0.01,
                              "c_prefill": 0.001, "c_prefill_ctx": 1e-6}))
    v2_cost = StepCost.load(str(v2))
    assert v2_cost.predict(hit) == pytest.approx(0.01 + 0.005 + (5 * 128 + 15) * 1e-6)
    for bad, says in (({"attention_tile": [32]}, "attention_tile"),
                      ({"prompt_pad_rows": -1}, "prompt_pad_rows"), ({"spread": [1.0, 0]}, "spread"),
                      ({"rho": 1.0}, "rho must be a number between -1 and 1"),
                      ({"extra_prompt_s": [0.1, "x"]}, "extra_prompt_s must be a list of finite numbers"),
                      ({"extra_s": [0.1], "spread": [1.2]}, "extra seconds or as factors, not both")):
        v2.write_text(json.dumps({"format": "prefixlab-step-cost", "version": 3, "c0": 0.01, **bad}))
        with pytest.raises(ValueError, match=says):
            StepCost.load(str(v2))


def test_a_fit_measures_how_slow_passes_follow_each_other_and_the_twin_draws_them_so():
    """`rho`: the lag-1 correlation of consecutive passes' draws. Slow passes in runs (every
    shape twice; each shape as often slow as fast) fit near 1, slow and fast by turns near -1,
    shuffled near 0; the twin's draws then switch between a spread's factors as seldom as the
    rho they were drawn with says."""
    import random
    true = StepCost(c0=0.02, c_prefill=0.001, c_decode=0.004)
    shapes = [StepShape(p, d) for p, d in itertools.product((0, 16, 128), (0, 1, 4, 8)) if p or d]
    order = [shapes[i % len(shapes)] for i in range(20 * len(shapes))]

    def fitted(extras):
        return fit(order, [true.predict(s) + e for s, e in zip(order, extras)]).rho
    in_runs = [0.05 if (i // (2 * len(shapes))) % 2 else -0.01 for i in range(len(order))]
    by_turns = [0.05 if i % 2 else -0.01 for i in range(len(order))]
    shuffled = in_runs[:]
    random.Random(3).shuffle(shuffled)
    assert fitted(in_runs) > 0.8 and fitted(by_turns) < -0.8 and abs(fitted(shuffled)) < 0.25
    assert fit(order, [true.predict(s) for s in order]).rho == 0.0   # no spread, nothing to follow

    def switches(rho):
        draw = PassTimes(StepCost(c0=1.0, spread=(0.5, 1.5), rho=rho), seed=0)
        got = [draw(StepShape(0, 1)) for _ in range(2000)]
        return sum(a != b for a, b in zip(got, got[1:])), got.count(1.5) / len(got)
    alone, chained = switches(0.0), switches(0.95)
    assert 800 < alone[0] < 1200 and chained[0] < 0.3 * alone[0]      # a factor seldom alone
    assert 0.3 < alone[1] < 0.7 and 0.3 < chained[1] < 0.7              # each factor half the time


def test_the_twin_adds_the_same_seconds_to_a_small_prompt_pass_as_to_a_large_one():
    """Version 6 keeps a pass's spread as seconds over the fit's time: in a slow spell of the
    host a small prompt pass ran 1.5-1.85 times its median and a large one 1.13-1.2 times, about
    the same seconds over it. The twin adds the extra drawn, and never runs a pass under half its
    fitted time."""
    cost = StepCost(c0=0.01, c_prompt=0.05, c_prefill=0.001, c_decode=0.002, extra_prompt_s=(0.1,),
                    extra_s=(-0.5,))
    small, large = prompt_shape(128, 30), prompt_shape(0, 900)
    draw = PassTimes(cost)
    for shape in (small, large):
        assert draw(shape) == pytest.approx(cost.predict(shape) + 0.1)
    decode = StepShape(decode_rows=4, decode_context=400)
    assert draw(decode) == pytest.approx(cost.predict(decode) * 0.5)   # -0.5 s: floored at half
    # fitted from passes slowed so, the extras hold the seconds, whatever each pass's size
    shapes = [prompt_shape(n, rows) for n in (0, 128) for rows in (30, 300, 900)] + \
             [StepShape(decode_rows=d, decode_context=d * c) for d in (1, 4, 8) for c in (50, 400)]
    times = [cost.predict(s) + e for s in shapes for e in ((0.0, 0.0, 0.15) if s.prefill_rows else (0, 0, 0))]
    got = fit([s for s in shapes for _ in range(3)], times)
    assert max(got.extra_prompt_s) == pytest.approx(0.15) and min(got.extra_prompt_s) == pytest.approx(0.0)
    # over the fit's time, not each shape's median: shapes the terms cannot fit (each timed alike
    # three times) leave the fit's misses in the spread, as the twin adds it to the fit's time
    missed = [cost.predict(s) * (1.5 if i % 2 else 0.8) for i, s in enumerate(shapes) for _ in range(3)]
    got = fit([s for s in shapes for _ in range(3)], missed)
    assert min(got.extra_prompt_s) < -0.01 and max(got.extra_prompt_s) > 0.01


def test_the_twin_draws_each_pass_from_the_cost_spread(tmp_path):
    """A spread of one factor doubles every pass of the hand-worked timeline; a spread of two
    draws per pass, the same for the same seed; `predict_draws` reports the mean of its draws."""
    doubled = StepCost(c0=1.0, c_prefill=0.125, c_decode=0.5, spread=(2.0,))
    done = []
    predict(_write(tmp_path, _small_trace()), TwinConfig(doubled, SETTINGS), per_request=done.append)
    got = {p.index: (p.admitted_s, p.first_token_s, p.end_s) for p in done}
    # the hand-worked timeline's first two passes twice as long (0-6, 6-10); C's decode pass then
    # starts at 10, as D arrives, and D's 4 prompt rows join it: 2 x (1 + 0.5 + 0.5) = 4 s
    assert got == {0: (0.0, 6.0, 10.0), 1: (0.0, 6.0, 6.0), 2: (6.0, 10.0, 14.0), 3: (10.0, 14.0, 14.0)}
    # a pass holding prompt rows draws from its own spread, the others from `spread`: with only
    # the decode passes doubled, the hand-worked timeline's one decode-only pass (C's second
    # token, 5-6.5) takes 3 s, 5-8
    decode_doubled = StepCost(c0=1.0, c_prefill=0.125, c_decode=0.5, spread=(2.0,), spread_prompt=(1.0,))
    done = []
    predict(_write(tmp_path, _small_trace(), "d.jsonl"), TwinConfig(decode_doubled, SETTINGS),
            per_request=done.append)
    got = {p.index: (p.admitted_s, p.first_token_s, p.end_s) for p in done}
    assert got == {0: (0.0, 3.0, 5.0), 1: (0.0, 3.0, 3.0), 2: (3.0, 5.0, 8.0), 3: (10.0, 11.5, 11.5)}
    two = StepCost(c0=1.0, c_prefill=0.125, c_decode=0.5, spread=(0.5, 1.5))
    trace = _write(tmp_path, _burst_trace(4.0), "burst.jsonl", 16)
    config = TwinConfig(two, SchedulerSettings(page_rows=16, max_streams=4))
    runs = [predict(trace, config) for _ in range(2)]
    assert runs[0].ttft_s == runs[1].ttft_s                         # seeded: a run repeats exactly
    seeds = [predict(trace, TwinConfig(two, config.settings, seed=k)) for k in range(3)]
    assert len({r.ttft_s["p90"] for r in seeds}) > 1                 # another seed, other draws
    mean, each = predict_draws(trace, config, 3, keep=True)
    assert mean.draws == 3 and len(each) == 3 and len(each[0]) == 24
    assert predict_draws(trace, config, 3)[1] == []          # kept only when asked: bounded memory
    assert mean.ttft_s["p90"] == pytest.approx(sum(r.ttft_s["p90"] for r in seeds) / 3)
    with pytest.raises(ValueError, match="draws"):
        predict_draws(trace, config, 0)


def test_calibrate_compares_a_new_fit_with_the_kept_one_in_standard_errors():
    kept = StepCost(c0=0.020, c_prefill=0.001, c_decode=0.004,
                    stderr={"c0": 0.0003, "c_prefill": 4e-5, "c_decode": 1e-4})
    near = StepCost(c0=0.0204, c_prefill=0.001, c_decode=0.004,
                    stderr={"c0": 0.0004, "c_prefill": 3e-5, "c_decode": 1e-4})
    cmp = compare_fits(kept, near)
    assert cmp["terms"]["c0"]["z"] == pytest.approx(0.8)           # 0.4 ms / hypot(0.3, 0.4) ms
    assert cmp["max_abs_z"] == pytest.approx(0.8)
    # no covariance kept (a version 2-7 file): the terms taken as independent, the distance the
    # sum of their z^2, over the three terms either fit has noise on (chi-square 95 %: 7.815)
    assert cmp["distance"] == pytest.approx(0.64) and cmp["terms_compared"] == 3 and cmp["within_noise"]
    far = StepCost(c0=0.020, c_prefill=0.0012, c_decode=0.004,
                   stderr={"c0": 0.0003, "c_prefill": 3e-5, "c_decode": 1e-4})
    cmp = compare_fits(kept, far)
    assert cmp["terms"]["c_prefill"]["z"] == pytest.approx(4.0) and not cmp["within_noise"]
    assert cmp["distance"] == pytest.approx(16.0)
    text = comparison_report(cmp)
    assert "NOT within noise" in text and "c_prefill" in text and "+4.0" in text and "16.0" in text
    # two fits without standard errors (version 1 files): no verdict
    unknown = compare_fits(StepCost(c0=0.020, c_prefill=0.001, c_decode=0.004),
                           StepCost(c0=0.020, c_prefill=0.0012, c_decode=0.004))
    assert unknown["distance"] is None and not unknown["within_noise"]
    assert "neither fit has its standard error" in comparison_report(unknown)
    assert cmp["pass_change"]["512 prefill rows"] == pytest.approx(512 * 0.0002 / (0.020 + 512 * 0.001))


def _with_covariance(c_prefill: float, c_prefill_ctx: float, rho: float) -> StepCost:
    se = {"c_prefill": 1e-4, "c_prefill_ctx": 1e-7}
    cov = [[0.0] * len(TERMS) for _ in TERMS]
    i, j = TERMS.index("c_prefill"), TERMS.index("c_prefill_ctx")
    cov[i][i], cov[j][j] = se["c_prefill"] ** 2, se["c_prefill_ctx"] ** 2
    cov[i][j] = cov[j][i] = rho * se["c_prefill"] * se["c_prefill_ctx"]
    return StepCost(c0=0.02, c_prefill=c_prefill, c_prefill_ctx=c_prefill_ctx, stderr=se, covariance=cov)


def test_two_fits_are_judged_by_all_their_terms_together_as_the_terms_trade_off():
    """Prefill rows and their pairs trade off: in a fit where they move against each other
    (correlation -0.9), one up and the other down by 1.5 standard errors each is the noise, both
    up by as much is not, though every term alone is as far (1.5 / sqrt(2) standard errors)."""
    kept = _with_covariance(1e-3, 1e-6, -0.9)
    traded = _with_covariance(1e-3 + 1.5e-4, 1e-6 - 1.5e-7, -0.9)
    both = _with_covariance(1e-3 + 1.5e-4, 1e-6 + 1.5e-7, -0.9)
    one, two = compare_fits(kept, traded), compare_fits(kept, both)
    assert one["max_abs_z"] == pytest.approx(two["max_abs_z"]) == pytest.approx(1.5 / 2 ** 0.5)
    # d' S^-1 d with S twice each fit's: (a^2 + b^2 - 2 rho a b) / (2 (1 - rho^2)), a = +-b = 1.5
    assert one["distance"] == pytest.approx(1.5 ** 2 * 2 * (1 - 0.9) / (2 * (1 - 0.81)))
    assert two["distance"] == pytest.approx(1.5 ** 2 * 2 * (1 + 0.9) / (2 * (1 - 0.81)))
    assert one["terms_compared"] == 2 and one["within_noise"] and not two["within_noise"]


def _host_calibration(seed: int, true: StepCost, per_run: float = 0.1, per_round: float = 0.0,
                      speeds: list | None = None) -> tuple[list[StepShape], list[float], list]:
    """A calibration on a host whose speed moves between a workload's runs (`per_run`: 10 % of its
    time, one draw per run) and between rounds (`per_round`: one draw for every workload's k-th
    run; each round's speed appended to `speeds`) far more than between passes of one run (1 %):
    six workloads of 8 passes, each run three times, each run a prompt pass then decode passes on
    top of it, or a batch decoding."""
    import random
    rng = random.Random(seed)
    workloads = [[prompt_shape(0, p)] + [StepShape(decode_rows=1, decode_context=p + k) for k in range(1, 8)]
                 for p in (16, 64, 256)]
    workloads += [[StepShape(decode_rows=d, decode_context=d * (40 + k)) for k in range(8)]
                  for d in (2, 4, 8)]
    shapes, seconds, groups = [], [], []
    for run in range(3):
        moment = rng.lognormvariate(0.0, per_round)
        if speeds is not None:
            speeds.append(moment)
        for w, passes in enumerate(workloads):
            speed = moment * rng.lognormvariate(0.0, per_run)
            for s in passes:
                shapes.append(s)
                seconds.append(true.predict(s) * speed * rng.lognormvariate(0.0, 0.01))
                groups.append((w, run * len(workloads) + w))
    return shapes, seconds, groups


def test_a_fits_standard_errors_see_the_host_move_between_the_runs_of_a_workload(monkeypatch):
    """The residuals of one calibration see the noise of passes close together; its runs of each
    workload see the host's speed move. Two calibrations of one host are within noise by the
    runs' spread about as often as the 95 % point says, and by the residuals' seldom."""
    import app.replay.stepcost as stepcost
    monkeypatch.setattr(stepcost, "RESAMPLES", 60)   # fewer draws: the suite's time
    true = StepCost(c0=0.02, c_prompt=0.03, c_prefill=0.001, c_decode=0.004, c_ctx=2e-6, c_prefill_ctx=1e-7)
    by_runs, by_residuals, wider = [], [], []
    for pair in range(8):
        a, b = _host_calibration(2 * pair, true), _host_calibration(2 * pair + 1, true)
        runs = [fit(*c[:2], groups=c[2]) for c in (a, b)]
        assert all(f.fit["stderr_from"] == "runs and rounds resampled" for f in runs)
        wider.append(runs[0].stderr["c_decode"] / runs[0].fit["residual_stderr"]["c_decode"])
        by_runs.append(compare_fits(*runs)["within_noise"])
        by_residuals.append(compare_fits(fit(*a[:2]), fit(*b[:2]))["within_noise"])
    # the 95 % point: about 7.6 of 8 pairs within noise by a right standard error
    assert sum(by_runs) >= 7 and sum(by_residuals) <= 3
    # a run's passes move together: the residuals take them as apart, and a term's error too small
    assert sorted(wider)[len(wider) // 2] > 3
    # a workload run once says nothing of the runs' spread: the residuals' standard errors
    shapes, seconds, groups = _host_calibration(99, true)
    assert fit(shapes, seconds, groups=[(i, 0) for i in range(len(shapes))]).fit["stderr_from"] == "residuals"


def test_a_fits_standard_errors_tell_a_host_slow_for_a_whole_round_from_a_changed_cost(monkeypatch):
    """calibrate runs its workloads in rounds; a host slow for a whole round (a neighbour's
    minute) slows every workload's run in it together. The fit names each round's level and
    draws the levels as one factor for every term, apart from the runs: two calibrations of such
    a host are within noise about as often as the 95 % point says, and a cost that did change
    (decoding 15 % dearer) is told from them. Each workload's runs drawn alone, with their
    round's level in them, take the host's moment for a change of the cost's shape (a workload
    of decoding slow, another fast), and such a change passes for noise."""
    import app.replay.stepcost as stepcost
    monkeypatch.setattr(stepcost, "RESAMPLES", 60)   # fewer draws: the suite's time
    true = StepCost(c0=0.02, c_prompt=0.03, c_prefill=0.001, c_decode=0.004, c_ctx=2e-6, c_prefill_ctx=1e-7)
    dearer = dataclasses.replace(true, c_decode=true.c_decode * 1.15)
    same, told = [], []
    for pair in range(8):
        speeds: list[float] = []
        a = _host_calibration(2 * pair, true, per_run=0.01, per_round=0.1, speeds=speeds)
        kept = fit(*a[:2], groups=a[2])
        # each round's level, over their mean: the host's speed in that round, over its mean
        mean = math.exp(sum(map(math.log, speeds)) / len(speeds))
        assert kept.fit["round_levels"] == pytest.approx([v / mean for v in speeds], rel=0.02)
        again, changed = (fit(*c[:2], groups=c[2])
                          for c in (_host_calibration(2 * pair + 1, cost, per_run=0.01, per_round=0.1)
                                    for cost in (true, dearer)))
        same.append(compare_fits(kept, again)["within_noise"])
        told.append(not compare_fits(kept, changed)["within_noise"])
    assert sum(same) >= 7 and sum(told) >= 7
    # calibrate prints the rounds' levels beside the errors they went into
    text = report(kept, list(zip(*a[:2])))
    assert "standard errors: c0" in text and "(runs and rounds resampled)" in text
    levels = " / ".join(f"{v:.2f}" for v in kept.fit["round_levels"])
    assert ("the host's speed in each round of the workloads (its passes' median time over the fit's): "
            + levels) in text


def test_calibrate_times_the_passes_of_prefix_cache_hits(tiny_model):
    """A calibration workload with a cached prefix runs the prefix alone, then its requests
    together: they attach the prefix and prefill only their own tokens on top of it, so the fit
    sees passes whose prefill rows attend a context they did not compute (serve's hits)."""
    from app.replay.calibrate import measure
    samples, groups = measure(tiny_model, workloads=[(0, [(8, 2)]), (32, [(16, 4)] * 2)])
    shapes = [s for s, _ in samples]
    assert groups == [(1, 1)] * len(samples)   # every fitted pass is the second workload's, its one run
    # the prefix's own pass: 32 fresh rows (row j attends j + 1 positions), then its answer
    assert shapes[0] == prompt_shape(0, 32)
    # the requests (arriving 50 ms apart, in one pass or two) hit the 32 cached tokens: 16 own
    # rows each, row j attending 32 + j + 1; nothing prefilled the prefix again
    hits = [s for s in shapes[1:] if s.prefill_rows]
    assert [p for s in hits for p in s.pieces] == [(32, 16), (32, 16)]
    # each workload starts after the engine idled: the first hit's pass is a hit after an idle
    # moment, the prefix's own pass (nothing cached yet) is not
    assert hits[0].hit_after_idle and not shapes[0].hit_after_idle
    assert all(s.prefill_context == len(s.pieces) * (16 * 32 + 16 * 17 // 2) for s in hits)
    # a decode pass is `after_prompt` when it is one of the first two after a prompt pass
    since = 2
    for s in shapes[1:]:
        if not s.prefill_rows:
            assert s.after_prompt == (since < 2)
        since = 0 if s.prefill_rows else since + 1
    assert sum(s.decode_rows for s in shapes[1:]) == 2 * 3   # each answer's 3 tokens after its first


MOONCAKE = os.path.join(os.path.dirname(__file__), "..", "resources", "traces", "mooncake",
                        "conversation_trace.jsonl")


def _scaled_mooncake(path: str, n: int, k: int = 16) -> None:
    """The shipped Mooncake trace's first n requests, arrivals and shared blocks as they are, each
    request's tokens divided by k (32-token blocks for 512), so the test runs in seconds."""
    reqs = []
    with open(MOONCAKE, encoding="utf-8") as fh:
        for line in itertools.islice(fh, n):
            o = json.loads(line)
            length = max(1, o["input_length"] // k)
            reqs.append(TraceRequest(arrival_s=o["timestamp"] / 1000, input_length=length,
                                     output_length=max(1, o["output_length"] // k),
                                     hash_ids=o["hash_ids"][:-(-length // (512 // k))]))
    write_trace(path, TraceHeader(block_size=512 // k), reqs)


def test_two_twins_behind_cache_aware_beat_round_robin_on_mooncake(tmp_path):
    path = str(tmp_path / "mooncake.jsonl")
    _scaled_mooncake(path, 600)
    cost = StepCost(c0=0.005, c_prefill=8e-4, c_decode=2e-3)
    print(f"per replica: a pass {cost.c0 * 1e3:g} ms + {cost.c_prefill * 1e3:g} ms a prefill row "
          f"({1 / cost.c_prefill:,.0f} prefill tokens/s) + {cost.c_decode * 1e3:g} ms a decode row")
    res = {}
    for router in ("round-robin", "cache-aware"):
        res[router] = r = predict(open_trace(path), TwinConfig(cost, SchedulerSettings(), replicas=2,
                                                               router=router))
        print(router, r.requests, f"hit ratio {r.token_hit_ratio:.3f}",
              {k: round(v, 3) for k, v in r.ttft_s.items()})
    rr, ca = res["round-robin"], res["cache-aware"]
    assert rr.requests == ca.requests == 600
    assert ca.token_hit_ratio > rr.token_hit_ratio
    for q in ("p50", "p90", "p99", "mean"):
        assert ca.ttft_s[q] < rr.ttft_s[q], q


def test_against_a_real_server_measures_every_request_beside_the_twin(tiny_model, tmp_path, capsys):
    """`replay --against` sends a small hash-id trace (two shared blocks) to a real `prefixlab
    serve` over HTTP on a free loopback port and prints measured beside predicted."""
    from app.cli import main
    from tests.serve_helpers import scheduler_on, start_server
    path = str(tmp_path / "burst.jsonl")
    write_trace(path, TraceHeader(block_size=16), [
        TraceRequest(arrival_s=0.05 * i, input_length=40, output_length=3, hash_ids=[1, 2, 10 + i])
        for i in range(5)])
    cost = str(tmp_path / "cost.json")
    StepCost(c0=0.01, c_prefill=1e-4, c_decode=1e-3).save(cost)
    server = start_server(scheduler_on(tiny_model, page_rows=16))
    try:
        out = str(tmp_path / "against.json")
        assert main(["replay", path, "--against", server.url, "--cost", cost, "--json", out]) == 0
    finally:
        server.stop()
    text = capsys.readouterr().out
    assert "measured 5 of 5 requests" in text and "TTFT p90: measured" in text
    got = json.loads(open(out, encoding="utf-8").read())
    assert got["compare"]["measured_ok"] == 5
    assert [m["tokens"] for m in got["measured"]] == [3] * 5      # each answer ran to its length
    assert all(m["ttft_s"] > 0 and m["total_s"] >= m["ttft_s"] for m in got["measured"])
    # every token streamed a piece of text, so the first piece timed is the first token's
    assert [m["pieces"] for m in got["measured"]] == [3] * 5
    # the server cached what the twin predicted it would: the shared blocks, once computed
    assert sum(m["cached_tokens"] or 0 for m in got["measured"]) > 0
    assert got["twin"]["token_hit_ratio"] > 0


def test_the_twin_command_names_what_is_wrong(tmp_path):
    from app.cli import main
    trace = _write(tmp_path, _small_trace()).path
    cost = str(tmp_path / "cost.json")
    COST.save(cost)
    with pytest.raises(SystemExit, match="cannot read the step-cost file .*nowhere.json"):
        main(["replay", trace, "--twin", "--cost", str(tmp_path / "nowhere.json")])
    with pytest.raises(SystemExit, match="one --replicas N and one --router"):
        main(["replay", trace, "--twin", "--cost", cost, "--replicas", "1,2"])
    with pytest.raises(SystemExit):
        main(["replay", trace, "--twin", "--cost", cost, "--slo-ttft", "-1"])


def test_the_twin_command_prints_percentiles_and_goodput(tmp_path, capsys):
    from app.cli import main
    trace = _write(tmp_path, _small_trace()).path
    cost, out = str(tmp_path / "cost.json"), str(tmp_path / "per.jsonl")
    COST.save(cost)
    assert main(["replay", trace, "--twin", "--cost", cost, "--page-rows", "4", "--chunk-tokens", "16",
                 "--max-streams", "2", "--slo-ttft", "4", "--per-request", out, "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "TTFT s   p50 3.000" in text
    assert "goodput under TTFT <= 4 s: 3 of 4 requests" in text     # C's TTFT is 5 s
    rows = [json.loads(line) for line in open(out, encoding="utf-8")]
    assert sorted(r["index"] for r in rows) == [0, 1, 2, 3] and rows[0]["ttft_s"] == 3.0


def test_the_bench_calibrates_between_bursts_that_each_end_before_the_next(tmp_path):
    """The bench's twin section sends calibrate's workloads between the trace's bursts: every
    workload once, in order, some before the first burst and after the last; and it compares
    only a trace whose bursts each end before the next one starts, in every draw of the twin
    (the server idles there, between them, for the workloads)."""
    from app.bench.twin import _bursts_drain, _chunks, burst_trace
    from app.replay.calibrate import WORKLOADS
    between = _chunks(WORKLOADS[1:], 11)
    assert [w for chunk in between for w in chunk] == list(WORKLOADS[1:]) and all(between)
    trace = str(tmp_path / "bursts.jsonl")
    burst_trace(trace, 3, 2)
    cost = StepCost(c0=0.01, c_prefill=0.001, c_decode=0.002)
    _, draws = predict_draws(open_trace(trace), TwinConfig(cost), 2, keep=True)
    assert _bursts_drain(trace, 2, draws)
    slow = StepCost(c0=0.5, c_prefill=0.001, c_decode=0.002)   # 8-16 tokens at 0.5 s: 4 s and more
    _, draws = predict_draws(open_trace(trace), TwinConfig(slow), 1, keep=True)
    assert not _bursts_drain(trace, 2, draws)


def test_the_bench_gives_the_measured_percentiles_their_own_error_over_its_bursts():
    """A burst's requests share its passes and the host's moment, so the bench resamples whole
    bursts for the measured TTFT's own standard error: bursts alike give none (resampling single
    requests would), bursts unlike give one."""
    from types import SimpleNamespace

    from app.bench.twin import _measured_spread
    alike = [SimpleNamespace(ttft_s=t) for _ in range(4) for t in (0.1, 0.2, 0.4)]
    assert max(_measured_spread(alike, 3).values()) < 1e-12   # every draw the same percentiles
    unlike = [SimpleNamespace(ttft_s=t) for b in range(4) for t in (0.1 * (b + 1),) * 3]
    spread = _measured_spread(unlike, 3)
    assert 0.1 < spread["p50"] < 1.0 and spread["p90"] > 0.05
    assert _measured_spread(unlike, 3) == spread   # seeded: a bench run's figure repeats
