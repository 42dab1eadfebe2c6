"""Bench section "twin" (docs/design.md §16): how far the twin's prediction is from the real server.

`prefixlab serve` on the bundled model as shipped (only its queue made long enough for the bursts,
and `--step-log` on). A trace of bursts of requests sharing one of three system prompts, at a rate
that queues, is sent `--against` it burst by burst, and between the bursts, while the server
would idle, `prefixlab calibrate --url`'s workloads (a few each time): so the fit the twin
predicts with, of the passes the server logged for those workloads, is timed in the same minutes
as the trace, under the same front end. This host's speed moves by 15-40 % from one minute to
the next (docs/twin.md, section 4), so a calibration made before the run measures another
machine than the one the trace ran on. Each burst starts on an idle server, in the twin as on
the server (the section checks it), so the twin predicts the trace as one, at its own times.
The same trace goes through the twin at that fit DRAWS times (each pass's time drawn from the
calibration's spread; the percentiles predicted are the draws' means). The figures with a
target are the twin's relative error on TTFT p50 and p90 (within 20 %); beside them, the
measured percentiles' own standard error (their bursts resampled), so an error can be read
against the noise of the measurement itself. The JSON keeps every pass the server logged.

Kept beside, without a target: the error at the server's calibration made whole before the run
(and how far it lies from the interleaved one: the largest difference of a coefficient in
standard errors), and at a plain `prefixlab calibrate` made in one process before the server
starts (the engine without the server's front end: docs/twin.md, section 4).
"""

from __future__ import annotations

import os
import random
import subprocess
import tempfile

import numpy as np

from ..replay import against, calibrate
from ..replay.stepcost import StepCost
from ..replay.steplog import logged_passes, read_step_log
from ..replay.trace import TraceHeader, TraceRequest, open_trace, write_trace
from ..replay.twin_replay import TwinConfig, predict_draws
from ..serve import loadtest
from .common import child_env, figure
from .serve import free_port

FEATURE = "twin"  # the table's and the JSON's "feature" of its figures
TARGET_ERROR = 0.20
BLOCK = 32
# 180 requests: the measured TTFT p90 of 60 (10 bursts) moved by 12-44 % (one standard error)
# when its bursts were resampled, more than the target allows (docs/twin.md, section 4)
BURSTS, PER_BURST, EVERY_S = 30, 6, 4.0
QUICK_BURSTS, QUICK_PER_BURST = 3, 3
DRAWS = 12   # the twin's runs of the trace, each pass's time drawn from the calibration's spread


def burst_trace(path: str, bursts: int, per_burst: int, seed: int = 7) -> int:
    """Bursts of requests 50 ms apart, each a 4-block system prompt (one of three) and a 1-2 block
    question of its own, 8-16 answer tokens; a burst every EVERY_S s (its requests are
    per_burst consecutive ones)."""
    rng = random.Random(seed)
    reqs, fresh = [], 1000
    for b in range(bursts):
        for j in range(per_burst):
            system = rng.randrange(3)
            own = rng.randint(1, 2)
            ids = [100 * system + k for k in range(4)] + list(range(fresh, fresh + own))
            fresh += own
            reqs.append(TraceRequest(arrival_s=b * EVERY_S + 0.05 * j, input_length=BLOCK * (4 + own) - 3,
                                     output_length=rng.randint(8, 16), hash_ids=ids))
    write_trace(path, TraceHeader(block_size=BLOCK, source="prefixlab bench twin"), reqs)
    return len(reqs)


def _calibrate(model_path: str, out: str) -> StepCost:
    subprocess.run([loadtest.python(), "-m", "app.cli", "calibrate", "--model", model_path,
                    "--out", out, "--quiet"], env=child_env(), check=True, capture_output=True)
    return StepCost.load(out)


SE_NOTE = "the measured percentile's own standard error, its bursts resampled (relative to it)"
BEFORE_NOTE = "the server's own calibration, made whole before the run"


def _calibrate_server(url: str, step_log: str, out: str) -> StepCost:
    """The server's own fit: calibrate's workloads sent to it, the passes it logged fitted."""
    subprocess.run([loadtest.python(), "-m", "app.cli", "calibrate", "--url", url, "--from-log", step_log,
                    "--out", out, "--quiet"], env=child_env(), check=True, capture_output=True)
    return StepCost.load(out)


def _interleaved(url: str, step_log: str, trace: str, per_burst: int) -> tuple[list, StepCost, list, list]:
    """The trace sent burst by burst, calibrate's workloads between the bursts (and before the
    first and after the last): (the requests measured, in trace order; the workloads' fit; the
    trace's own passes, (shape, seconds), as the server logged them; every pass logged, `_passes`)."""
    reqs = against.requests_of(open_trace(trace), 1.0)
    bursts = [list(range(i, min(i + per_burst, len(reqs)))) for i in range(0, len(reqs), per_burst)]
    cal = calibrate.ServerCalibration(url, step_log)
    cal.send(calibrate.WORKLOADS[:1], fitted=False)   # the warm-up
    between = _chunks(calibrate.WORKLOADS[1:], len(bursts) + 1)
    measured = []
    for burst, workloads in zip(bursts, between):
        cal.send(workloads)
        t0 = reqs[burst[0]][0]
        got = against.send_requests(url, [(reqs[i][0] - t0, *reqs[i][1:]) for i in burst])
        for i, m in zip(burst, got):   # back on the trace's clock and its indices
            m.index, m.arrival_s = i, reqs[i][0]
        measured += got
    cal.send(between[-1])
    bursts_logged = [(a[1], b[0]) for a, b in zip(cal.spans, cal.spans[1:])]   # between the workloads'
    return measured, cal.fit()[0], [p for _, passes in logged_passes(step_log, spans=bursts_logged)
                                    for p in passes], _passes(step_log, cal.spans, bursts_logged)


def _passes(step_log: str, fitted: list, bursts: list) -> list[dict]:
    """Every pass the server logged, in order, for the JSON (a figure can be worked out again from
    it): its start and seconds, decode streams and prompt pieces, and what ran it ("fit": the
    interleaved calibration's workloads; "trace"; "other": the whole calibration before, warm-ups)."""
    def part(at: int) -> str:
        inside = lambda spans: any(a <= at < b for a, b in spans)   # noqa: E731
        return "fit" if inside(fitted) else "trace" if inside(bursts) else "other"
    return [{"start": start, "seconds": seconds, "decode": decode, "pieces": pieces, "part": part(at)}
            for _, passes in read_step_log(step_log) for at, decode, pieces, seconds, start in passes]


def _pass_ratios(cost: StepCost, passes: list) -> dict:
    """The median of the trace's passes' seconds over the fit's, prompt passes and decode-only
    ones apart: whether an error is the passes' time (the machine) or the order they ran in."""
    ratios = {"prompt": [], "decode": []}
    for shape, seconds in passes:
        ratios["prompt" if shape.prefill_rows else "decode"].append(seconds / cost.predict(shape))
    return {k: float(np.median(v)) if v else None for k, v in ratios.items()}


RESAMPLES = 2000   # of the measured bursts, for the measured percentiles' own standard error


def _measured_spread(measured: list, per_burst: int, seed: int = 0) -> dict:
    """The measured TTFT p50's and p90's own standard error, relative to them: the bursts drawn
    again with replacement (a block bootstrap: a burst's requests share its passes and the host's
    moment, so they vary together), the percentiles' standard deviation over RESAMPLES draws."""
    ttft = np.array([m.ttft_s for m in measured], dtype=np.float64)
    blocks = [ttft[i:i + per_burst] for i in range(0, len(ttft), per_burst)]
    rng = np.random.default_rng(seed)
    picks = [np.concatenate([blocks[k] for k in rng.integers(0, len(blocks), len(blocks))])
             for _ in range(RESAMPLES)]
    return {f"p{q}": float(np.std([np.percentile(p, q) for p in picks]) / np.percentile(ttft, q))
            for q in (50, 90)}


def _chunks(items: tuple, n: int) -> list[tuple]:
    """`items` in order, cut into n runs of sizes as even as they can be."""
    cuts = [round(k * len(items) / n) for k in range(n + 1)]
    return [items[a:b] for a, b in zip(cuts, cuts[1:])]


def _bursts_drain(trace: str, per_burst: int, draws: list[dict]) -> bool:
    """Whether every burst has ended, in every draw of the twin, before the next one's first
    arrival (the server idles then, between the bursts, for the calibration's workloads)."""
    arrivals = [r.arrival_s for r in open_trace(trace)]
    firsts = arrivals[per_burst::per_burst]
    return all(max(run[i].end_s for i in range(k * per_burst, (k + 1) * per_burst)) < first
               for run in draws for k, first in enumerate(firsts))


def _predict(trace: str, cost: StepCost) -> tuple[list[dict], object]:
    res, runs = predict_draws(open_trace(trace), TwinConfig(cost), DRAWS, keep=True)  # serve's settings
    return runs, res


def _served(model_path: str, tmp: str, trace: str, per_burst: int
            ) -> tuple[StepCost, list, StepCost, list, list]:
    """`prefixlab serve --step-log` calibrated whole, then the trace sent with the calibration's
    workloads between its bursts: (the whole fit; the requests measured; the interleaved fit; the
    trace's own passes; every pass logged)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    steps = os.path.join(tmp, "steps.jsonl")
    proc = loadtest.start_server([loadtest.python(), "-m", "app.cli", "serve", "--model", model_path,
                                  "--port", str(port), "--max-queue", "512", "--step-log", steps],
                                 base + "/v1", env=child_env(), ready_path="/health")
    try:
        before = _calibrate_server(base, steps, os.path.join(tmp, "cost-before.json"))
        warm = os.path.join(tmp, "warm.jsonl")  # first-use costs (workspaces, pages) are no queue
        write_trace(warm, TraceHeader(block_size=BLOCK), [
            TraceRequest(arrival_s=0.0, input_length=BLOCK * 5, output_length=4,
                         hash_ids=[9000 + k for k in range(5)])])
        against.send(base, open_trace(warm))
        # the fit the twin predicts with: this server's own passes, between the trace's bursts
        return (before, *_interleaved(base, steps, trace, per_burst))
    finally:
        loadtest.stop_server(proc)


def twin_figures(model_path: str, quick: bool) -> tuple[dict, dict]:
    bursts, per_burst = (QUICK_BURSTS, QUICK_PER_BURST) if quick else (BURSTS, PER_BURST)
    with tempfile.TemporaryDirectory(prefix="prefixlab-bench-twin-") as tmp:
        # the engine alone, in one process (`prefixlab calibrate`): kept beside, without a target
        in_process = _calibrate(model_path, os.path.join(tmp, "cost-in-process.json"))
        trace = os.path.join(tmp, "trace.jsonl")
        n = burst_trace(trace, bursts, per_burst)
        before, measured, cost, trace_passes, passes = _served(model_path, tmp, trace, per_burst)
        predicted, res = _predict(trace, cost)
        predicted_before, _ = _predict(trace, before)
        predicted_in_process, _ = _predict(trace, in_process)
        if not _bursts_drain(trace, per_burst, predicted):
            raise RuntimeError("the twin ran a burst into the next one: the trace's bursts, sent one by one "
                               "with the calibration's workloads between them, are not the trace it predicts")
    cmp = against.compare(measured, predicted)
    cmp_before = against.compare(measured, predicted_before)
    cmp_in_process = against.compare(measured, predicted_in_process)
    repeat = calibrate.compare(before, cost)
    if cmp["measured_ok"] != n:
        raise RuntimeError(f"only {cmp['measured_ok']} of {n} requests measured: {cmp['errors'][:3]}")
    # the calibration's pages must not have pushed the trace's system prompts out of the cache
    hits_differ = [m.index for m in measured if m.cached_tokens != predicted[0][m.index].cached_tokens]
    ratios = _pass_ratios(cost, trace_passes)
    spread = _measured_spread(measured, per_burst)
    err = {k: cmp[k]["error"] for k in ("ttft", "total")}
    note = (f"{n} requests in bursts, 3 shared system prompts, against prefixlab serve; calibrated "
            f"between the bursts")
    in_process_note = "fitted by `prefixlab calibrate` in one process, without the server's front end"
    figures = {
        "twin_ttft_p50_error": figure(abs(err["ttft"]["p50"]), "ratio", FEATURE, TARGET_ERROR, "<=",
                                      note=note),
        "twin_ttft_p90_error": figure(abs(err["ttft"]["p90"]), "ratio", FEATURE, TARGET_ERROR, "<=",
                                      note=note),
        "twin_ttft_p99_error": figure(abs(err["ttft"]["p99"]), "ratio", FEATURE),
        "twin_total_p50_error": figure(abs(err["total"]["p50"]), "ratio", FEATURE),
        "twin_total_p90_error": figure(abs(err["total"]["p90"]), "ratio", FEATURE),
        **{f"twin_ttft_{q}_measured_se": figure(spread[q], "ratio", FEATURE, note=SE_NOTE) for q in spread},
        "twin_requests_hits_differ": figure(len(hits_differ), "requests", FEATURE, 0, "<=",
                                            note="requests whose cached tokens the server reported other "
                                                 "than the twin predicted"),
        "twin_trace_prompt_pass_ratio": figure(ratios["prompt"], "ratio", FEATURE,
                                               note="the trace's prompt passes' median time over the fit's"),
        "twin_trace_decode_pass_ratio": figure(ratios["decode"], "ratio", FEATURE,
                                               note="the trace's decode passes' median time over the fit's"),
        "twin_ttft_p50_error_before_run": figure(abs(cmp_before["ttft"]["error"]["p50"]), "ratio", FEATURE,
                                                 note=BEFORE_NOTE),
        "twin_ttft_p90_error_before_run": figure(abs(cmp_before["ttft"]["error"]["p90"]), "ratio", FEATURE,
                                                 note=BEFORE_NOTE),
        "twin_ttft_p50_error_in_process_fit": figure(abs(cmp_in_process["ttft"]["error"]["p50"]), "ratio",
                                                     FEATURE, note=in_process_note),
        "twin_ttft_p90_error_in_process_fit": figure(abs(cmp_in_process["ttft"]["error"]["p90"]), "ratio",
                                                     FEATURE, note=in_process_note),
        "calibration_repeat_pass_change": figure(repeat["max_abs_pass_change"], "ratio", FEATURE,
                                                 note="largest change of a typical pass's predicted time, "
                                                      "the server's calibration before the run and the one "
                                                      "between its bursts"),
        "calibration_repeat_max_z": figure(repeat["max_abs_z"], "standard errors", FEATURE,
                                           note="largest coefficient difference, the server's calibration "
                                                "before the run and the one between its bursts"),
        "calibration_repeat_distance": figure(
            None if repeat["distance"] is None or not repeat["distance_limit"]
            else repeat["distance"] / repeat["distance_limit"], "ratio", FEATURE, 1.0, "<=",
            note="the two calibrations' difference, all terms together, over the chi-square's 95 % "
                 "point (under 1: within noise; calibrate.compare)"),
    }
    details = {"compare": cmp, "compare_before_run": cmp_before, "compare_in_process_fit": cmp_in_process,
               "calibration_repeat": repeat, "cost": cost.to_json(), "cost_before_run": before.to_json(),
               "cost_in_process": in_process.to_json(), "twin": res.to_json(), "hits_differ": hits_differ,
               "trace_pass_ratios": ratios, "measured_se": spread,
               "trace_pass_ratios_before_run": _pass_ratios(before, trace_passes),
               "measured": [m.__dict__ for m in measured],
               "predicted": [predicted[0][i].to_json() for i in sorted(predicted[0])], "passes": passes}
    return figures, details
