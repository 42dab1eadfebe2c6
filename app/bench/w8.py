"""Bench section "w8": the W8 workload as a user runs it, whole `prefixlab run` processes.

W8 (resources/scenarios/w8.json, the one copy of the workload): a 129-token shared
system prompt, eight questions, up to 32 greedy tokens each, default settings. Figures
(feature "W8 workload"):
- the first token: `prefixlab run` of W8's first question with --max-new 1, process start
  to exit (so an upper bound on the first token's time), on a warm weight image;
- W8's wall time on the idle machine, then with one and with two busy-loop processes
  (another program on a core, a compiler on both), as ratios to the idle time. A fair share
  of two cores among three processes is 3x; the engine must not lose much more than that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import time

from ..scenario import SCENARIO_DIR, Scenario, load_scenario
from .common import figure, ratio, target, timed_child

FEATURE = "W8 workload"  # the table's and the JSON's "feature" of its figures
W8_FILE = os.path.join(SCENARIO_DIR, "w8.json")
BUSY_LOOP = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"


def load_w8() -> Scenario:
    """The W8 workload: a scenario like any other, so the app and `prefixlab run` open it too."""
    return load_scenario(W8_FILE)


@contextlib.contextmanager
def busy_processes(n: int, seconds: float = 600.0):
    """`n` processes that each keep a core busy while the block runs (at most `seconds`)."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP.format(s=float(seconds))])
             for _ in range(n)]
    try:
        time.sleep(0.5)  # running, and counted in /proc/stat, before the measured process starts
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def ours_cmd(path: str, w8: Scenario, prompts: list[str] | None = None,
             max_new: int | None = None) -> list[str]:
    """`prefixlab run` of W8 (or some of its prompts) with default settings."""
    cmd = [sys.executable, "-m", "app.cli", "run", "--model", path, "--system", w8.system,
           "--max-new", str(max_new or w8.max_new_tokens), "--quiet"]
    for q in prompts or w8.prompts:
        cmd += ["--prompt", q]
    return cmd


def w8_figures(path: str, quick: bool) -> tuple[dict, dict]:
    w8 = load_w8()
    if quick:  # two prompts, two tokens: the figures exist, nothing more
        w8 = dataclasses.replace(w8, prompts=w8.prompts[:2], max_new_tokens=2)
    reps = 1 if quick else 3
    full = ours_cmd(path, w8)
    first = ours_cmd(path, w8, prompts=w8.prompts[:1], max_new=1)
    timed_child(full)                                    # a warm weight image and page cache
    walls: dict[str, list[float]] = {"first_token": [], "idle": [], "busy1": [], "busy2": []}
    for _ in range(reps):
        walls["first_token"].append(timed_child(first)[0])
        walls["idle"].append(timed_child(full)[0])
    for n in (1, 2):
        with busy_processes(n):
            walls[f"busy{n}"] = [timed_child(full)[0] for _ in range(max(1, reps - 1))]
    idle = min(walls["idle"])
    figures = {
        "w8_first_token_s": figure(min(walls["first_token"]), "s", FEATURE, **target("w8_first_token_s"),
                                   note="`prefixlab run` of one W8 question, --max-new 1: process "
                                        "start to exit, warm weight image"),
        "w8_wall_s": figure(idle, "s", FEATURE, note="`prefixlab run` W8, default settings, whole "
                                                   f"process, idle machine, best of {reps}"),
        "w8_one_busy_ratio": figure(ratio(min(walls["busy1"]), idle), "x", FEATURE,
                                    **target("w8_one_busy_ratio"),
                                    note=f"W8 with one busy-loop process: {min(walls['busy1']):.2f} s"),
        "w8_two_busy_ratio": figure(ratio(min(walls["busy2"]), idle), "x", FEATURE,
                                    **target("w8_two_busy_ratio"),
                                    note=f"W8 with two busy-loop processes: {min(walls['busy2']):.2f} s "
                                         "(a fair share of 2 cores among 3 is 3x)"),
    }
    return figures, {"w8": W8_FILE, "prompts": len(w8.prompts), "max_new": w8.max_new_tokens,
                     "reps": reps, "walls": walls}
