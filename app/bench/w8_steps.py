"""Bench figures of the W8 workload's own timeline: a decode step of 8 streams against one
stream's, and the run's peak RSS (feature "W8 workload").

A child process loads the model, runs W8's eight questions at once (default scheduler
settings, in-process, as `prefixlab run` does), notes its peak RSS (VmHWM: load + the
W8 run), then runs W8's first question alone. Both medians come from the scheduler's own
timeline, counting only pure decode steps (no prefill in the step) of 8 and of 1 streams.
Run `python -m app.bench.w8_steps --child ...` only through `w8_step_figures`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np

from .common import child_env, figure, peak_rss_mb, ratio, target

FEATURE = "W8 workload"  # the table's and the JSON's "feature" of its figures
STREAMS = 8


def decode_steps(timeline_rows, streams: int) -> list[float]:
    """Seconds of every step that only decoded, one token for each of `streams` streams."""
    out, prev = [], None
    for row in timeline_rows:
        computed = row.prefill_computed - (prev.prefill_computed if prev else 0)
        if computed == 0 and row.batch_size == streams and row.active == streams:
            out.append(row.step_s)
        prev = row
    return out


def _run(m, prompts: list[list[int]], max_new: int) -> list[float]:
    from engine.loop import EngineLoop

    loop = EngineLoop(m)
    sched = loop.scheduler
    for p in prompts:
        loop.submit_now(prompt=p, max_new_tokens=max_new, stop_ids=[])
    loop.run_until_done()
    return decode_steps(sched.timeline.rows, len(prompts))


def _child(path: str, max_new: int) -> dict:
    import engine as dl
    from engine.chat import chat_prompt, turn_messages

    from .w8 import load_w8

    m = dl.load_model(path)
    w8 = load_w8()
    prompts = [chat_prompt(m.tokenizer, turn_messages(w8.system, q)) for q in w8.prompts[:STREAMS]]
    many = _run(m, prompts, max_new)
    peak_mb = peak_rss_mb()
    one = _run(m, prompts[:1], max_new)
    return {"steps_8": many, "steps_1": one, "w8_peak_rss_mb": peak_mb, "max_new": max_new,
            "from_image": m.from_image}


def w8_step_figures(path: str, cache_dir: str | None, quick: bool) -> tuple[dict, dict]:
    """batch8_step_ratio and w8_peak_rss_mb, from one child process."""
    max_new = 8 if quick else 32
    extra = {"PREFIXLAB_CACHE_DIR": cache_dir} if cache_dir else {}
    cmd = [sys.executable, "-m", "app.bench.w8_steps", "--child", path, str(max_new)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=child_env(**extra))
    if out.returncode != 0:
        raise RuntimeError(f"w8 steps child failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    d = json.loads(out.stdout.strip().splitlines()[-1])
    med8 = float(np.median(d["steps_8"])) if d["steps_8"] else None
    med1 = float(np.median(d["steps_1"])) if d["steps_1"] else None
    figures = {
        "batch8_step_ratio": figure(ratio(med8, med1), "x", FEATURE, **target("batch8_step_ratio"),
                                    note=f"W8's median decode step of {STREAMS} streams "
                                         f"({_ms(med8)}) over one stream's ({_ms(med1)}), one process"),
        "w8_peak_rss_mb": figure(d["w8_peak_rss_mb"], "MB", FEATURE, **target("w8_peak_rss_mb"),
                                 note=f"peak RSS (VmHWM) of a process that loads the model and runs W8 "
                                      f"({STREAMS} questions, {max_new} tokens each)"),
    }
    return figures, {**d, "median_step_8_s": med8, "median_step_1_s": med1}


def _ms(s: float | None) -> str:
    return "?" if s is None else f"{s * 1e3:.1f} ms"


def _main() -> int:
    import engine
    engine.tune_process()  # NumPy is loaded: OpenBLAS has its timeout from the parent's environment
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--child", nargs=2, metavar=("MODEL", "MAX_NEW"), required=True)
    a = p.parse_args()
    print(json.dumps(_child(a.child[0], int(a.child[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
