"""Bench section "twin" (docs/design.md §16): how far the twin's prediction is from the real server.

`prefixlab serve` on the bundled model as shipped (only its queue made long enough for the bursts,
and `--step-log` on), calibrated on itself: `prefixlab calibrate --url` sends it calibrate's
workloads and fits the passes it logged, under its own front end. Then a trace of bursts of
requests sharing one of three system prompts, at a rate that queues, sent `--against` it; the same
trace through the twin at that fit, DRAWS times (each pass's time drawn from the calibration's
spread; the percentiles predicted are the draws' means). The figures are the twin's relative
error on TTFT p50 and p90 (target: within 20 %) and on the total time's.

A second calibration of the server after the run says how repeatable a calibration is here (the
largest difference of a coefficient in standard errors) and how far the machine's speed moved
during the run: the twin's error at that calibration is kept beside, as a figure without a
target (the figure with the target is the one calibrated before the run, never after it). So is
the error at a plain `prefixlab calibrate` made in one process before the server starts (the
engine without the server's front end: docs/twin.md, section 4).
"""

from __future__ import annotations

import os
import random
import subprocess
import tempfile

from ..replay import against, calibrate
from ..replay.stepcost import StepCost
from ..replay.trace import TraceHeader, TraceRequest, open_trace, write_trace
from ..replay.twin_replay import TwinConfig, predict_draws
from ..serve import loadtest
from .common import child_env, figure
from .serve import free_port

FEATURE = "twin"  # the table's and the JSON's "feature" of its figures
TARGET_ERROR = 0.20
BLOCK = 32
BURSTS, PER_BURST, EVERY_S = 10, 6, 4.0          # 60 requests
QUICK_BURSTS, QUICK_PER_BURST = 3, 3
DRAWS = 12   # the twin's runs of the trace, each pass's time drawn from the calibration's spread


def burst_trace(path: str, bursts: int, per_burst: int, seed: int = 7) -> int:
    """Bursts of requests 50 ms apart, each a 4-block system prompt (one of three) and a 1-2 block
    question of its own, 8-16 answer tokens; a burst every EVERY_S s."""
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


AFTER_NOTE = "the server's calibration after the run (machine drift)"


def _calibrate_server(url: str, step_log: str, out: str) -> StepCost:
    """The server's own fit: calibrate's workloads sent to it, the passes it logged fitted."""
    subprocess.run([loadtest.python(), "-m", "app.cli", "calibrate", "--url", url, "--from-log", step_log,
                    "--out", out, "--quiet"], env=child_env(), check=True, capture_output=True)
    return StepCost.load(out)


def _predict(trace: str, cost: StepCost) -> tuple[list[dict], object]:
    res, runs = predict_draws(open_trace(trace), TwinConfig(cost), DRAWS, keep=True)  # serve's settings
    return runs, res


def twin_figures(model_path: str, quick: bool) -> tuple[dict, dict]:
    with tempfile.TemporaryDirectory(prefix="prefixlab-bench-twin-") as tmp:
        # the engine alone, in one process (`prefixlab calibrate`): kept beside, without a target
        in_process = _calibrate(model_path, os.path.join(tmp, "cost-in-process.json"))
        trace = os.path.join(tmp, "trace.jsonl")
        n = burst_trace(trace, *((QUICK_BURSTS, QUICK_PER_BURST) if quick else (BURSTS, PER_BURST)))
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        steps = os.path.join(tmp, "steps.jsonl")
        proc = loadtest.start_server([loadtest.python(), "-m", "app.cli", "serve", "--model", model_path,
                                      "--port", str(port), "--max-queue", "512", "--step-log", steps],
                                     base + "/v1", env=child_env(), ready_path="/health")
        try:
            # the fit the twin predicts with: this server's own passes, under its own front end
            cost = _calibrate_server(base, steps, os.path.join(tmp, "cost.json"))
            warm = os.path.join(tmp, "warm.jsonl")  # first-use costs (workspaces, pages) are no queue
            write_trace(warm, TraceHeader(block_size=BLOCK), [
                TraceRequest(arrival_s=0.0, input_length=BLOCK * 5, output_length=4,
                             hash_ids=[9000 + k for k in range(5)])])
            against.send(base, open_trace(warm))
            measured = against.send(base, open_trace(trace))
            after = _calibrate_server(base, steps, os.path.join(tmp, "cost-after.json"))
        finally:
            loadtest.stop_server(proc)
        predicted, res = _predict(trace, cost)
        predicted_after, _ = _predict(trace, after)
        predicted_in_process, _ = _predict(trace, in_process)
    cmp = against.compare(measured, predicted)
    cmp_after = against.compare(measured, predicted_after)
    cmp_in_process = against.compare(measured, predicted_in_process)
    repeat = calibrate.compare(cost, after)
    if cmp["measured_ok"] != n:
        raise RuntimeError(f"only {cmp['measured_ok']} of {n} requests measured: {cmp['errors'][:3]}")
    err = {k: cmp[k]["error"] for k in ("ttft", "total")}
    note = f"{n} requests in bursts, 3 shared system prompts, against prefixlab serve"
    figures = {
        "twin_ttft_p50_error": figure(abs(err["ttft"]["p50"]), "ratio", FEATURE, TARGET_ERROR, "<=",
                                      note=note),
        "twin_ttft_p90_error": figure(abs(err["ttft"]["p90"]), "ratio", FEATURE, TARGET_ERROR, "<=",
                                      note=note),
        "twin_ttft_p99_error": figure(abs(err["ttft"]["p99"]), "ratio", FEATURE),
        "twin_total_p50_error": figure(abs(err["total"]["p50"]), "ratio", FEATURE),
        "twin_total_p90_error": figure(abs(err["total"]["p90"]), "ratio", FEATURE),
        "twin_ttft_p50_error_recalibrated": figure(abs(cmp_after["ttft"]["error"]["p50"]), "ratio", FEATURE,
                                                   note=AFTER_NOTE),
        "twin_ttft_p90_error_recalibrated": figure(abs(cmp_after["ttft"]["error"]["p90"]), "ratio", FEATURE,
                                                   note=AFTER_NOTE),
        "twin_ttft_p50_error_in_process_fit": figure(abs(cmp_in_process["ttft"]["error"]["p50"]), "ratio",
                                                     FEATURE, note="fitted by `prefixlab calibrate` in one "
                                                                   "process, without the server's front end"),
        "twin_ttft_p90_error_in_process_fit": figure(abs(cmp_in_process["ttft"]["error"]["p90"]), "ratio",
                                                     FEATURE, note="fitted by `prefixlab calibrate` in one "
                                                                   "process, without the server's front end"),
        "calibration_repeat_pass_change": figure(repeat["max_abs_pass_change"], "ratio", FEATURE,
                                                 note="largest change of a typical pass's predicted time, "
                                                      "the server's calibrations before and after the run"),
        "calibration_repeat_max_z": figure(repeat["max_abs_z"], "standard errors", FEATURE,
                                           calibrate.SAME_WITHIN_SE, "<=",
                                           note="largest coefficient difference, the server's calibrations "
                                                "before and after the run"),
    }
    details = {"compare": cmp, "compare_recalibrated": cmp_after, "compare_in_process_fit": cmp_in_process,
               "calibration_repeat": repeat, "cost": cost.to_json(), "cost_after": after.to_json(),
               "cost_in_process": in_process.to_json(), "twin": res.to_json(),
               "measured": [m.__dict__ for m in measured],
               "predicted": [predicted[0][i].to_json() for i in sorted(predicted[0])]}
    return figures, details
