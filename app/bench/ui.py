"""Bench section "desktop app": the eight-question scenario in the real window against headless.

A child process (QT_QPA_PLATFORM=offscreen, app/bench/ui_child.py) runs the scenario with the
app's default settings through the real Desktop (controller, worker thread, the MainWindow
with its charts and cache panel refreshing) and through `prefixlab run`'s headless path, in
alternating rounds, and reports the medians: the app/headless wall-time ratio and the UI
thread's longest stall (the longest gap between ticks of a 10 ms QTimer). The same rounds
then run with one bounded busy-loop process on the machine. When the app cannot start the
section reports why instead.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from .common import child_env, figure, target

FEATURE = "desktop app"  # the table's and the JSON's "feature" of its figures
TICK_MS = 10
ROUNDS = 9  # a round's ratio varies by +-15% on a shared 2-core machine: the median of 5 moved 1.13-1.21


def driver_available() -> str | None:
    """None when app.desktop.engine_driver (the desktop's engine thread) exists, else why not."""
    if importlib.util.find_spec("app.desktop.engine_driver") is None:
        return "app/desktop/engine_driver.py does not exist"
    if importlib.util.find_spec("PySide6") is None:
        return "PySide6 is not installed"
    return None


def ui_figures(model_path: str, quick: bool, cache_dir: str | None) -> tuple[dict, dict]:
    why = driver_available()
    if why is not None:
        return {}, {"available": False, "reason": why}
    extra = {"QT_QPA_PLATFORM": "offscreen"}
    if cache_dir:
        extra["PREFIXLAB_CACHE_DIR"] = cache_dir
    rounds = 1 if quick else ROUNDS
    cmd = [sys.executable, "-m", "app.bench.ui_child", model_path or "", str(int(quick)), str(rounds), "1"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=child_env(**extra))
    except subprocess.TimeoutExpired:
        return {}, {"available": False, "reason": "the UI child did not finish within 1800 s"}
    if out.returncode != 0 or not out.stdout.strip():
        return {}, {"available": False,
                    "reason": f"the UI child failed ({out.returncode}): {out.stderr.strip()[-1500:]}"}
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if r.get("error"):
        return {}, {"available": False, "reason": r["error"], **r}
    idle, busy = r["idle"], r.get("busy")
    what = f"{r['prompts']} prompts x {r['new_tokens']} tokens, app defaults, median of {rounds}"
    figures = {
        "ui_app_headless_ratio": figure(idle["ratio"], "x", FEATURE, **target("ui_app_headless_ratio"),
                                        note=f"wall time in the real window / headless ({what})"),
        "ui_app_s": figure(idle["app_s"], "s", FEATURE, note=f"the scenario in the window ({what})"),
        "ui_headless_s": figure(idle["headless_s"], "s", FEATURE, note=f"the scenario headless ({what})"),
        "ui_max_gap_ms": figure(idle["max_gap_ms"], "ms", FEATURE, **target("ui_max_gap_ms"),
                                note=f"longest gap between {TICK_MS} ms QTimer ticks on the UI thread "
                                     f"while the window runs the scenario ({what})"),
    }
    if busy is not None:
        figures["ui_busy_max_gap_ms"] = figure(busy["max_gap_ms"], "ms", FEATURE,
                                               **target("ui_busy_max_gap_ms"),
                                               note="the same with one busy-loop process on the machine")
        figures["ui_busy_app_headless_ratio"] = figure(busy["ratio"], "x", FEATURE,
                                                       note="app / headless with one busy-loop process")
    return figures, {"available": True, **r}


if __name__ == "__main__":
    from .ui_child import main
    sys.exit(main())
