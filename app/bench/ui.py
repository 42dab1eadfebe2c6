"""Bench section "desktop app": UI-thread responsiveness while the worker runs 8 streams.

A child process (QT_QPA_PLATFORM=offscreen) starts app.worker's EngineClient, loads the
model, submits the eight-question scenario with max_streams 8, and records the gaps
between ticks of a 10 ms QTimer on the UI thread until the run finishes. The figure is
the longest gap. When app.worker is missing or broken the section reports why instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

from .common import child_env, figure, target

ISSUE = "desktop app"
TICK_MS = 10


def worker_available() -> str | None:
    """None when app.worker and its EngineClient exist, else why not."""
    if importlib.util.find_spec("app.worker") is None:
        return "app/worker.py does not exist"
    if importlib.util.find_spec("PySide6") is None:
        return "PySide6 is not installed"
    return None


def ui_figures(model_path: str, quick: bool, cache_dir: str | None) -> tuple[dict, dict]:
    why = worker_available()
    if why is not None:
        return {}, {"available": False, "reason": why}
    n_new, n_prompts, sentences = (2, 2, 3) if quick else (48, 8, 0)
    extra = {"QT_QPA_PLATFORM": "offscreen"}
    if cache_dir:
        extra["PREFIXLAB_CACHE_DIR"] = cache_dir
    cmd = [sys.executable, "-m", "app.bench.ui", "--child", model_path, str(n_new), str(n_prompts),
           str(sentences)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=child_env(**extra))
    except subprocess.TimeoutExpired:
        return {}, {"available": False, "reason": "the UI child did not finish within 600 s"}
    if out.returncode != 0 or not out.stdout.strip():
        return {}, {"available": False,
                    "reason": f"the UI child failed ({out.returncode}): {out.stderr.strip()[-1500:]}"}
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if r.get("error"):
        return {}, {"available": False, "reason": r["error"], **r}
    figures = {
        "ui_max_gap_ms": figure(r["max_gap_ms"], "ms", ISSUE, **target("ui_max_gap_ms"),
                                note=f"longest gap between {TICK_MS} ms QTimer ticks, "
                                     f"{r['streams']} streams (max_streams 8) x {n_new} tokens "
                                     f"via EngineWorker"),
        "ui_p99_gap_ms": figure(r["p99_gap_ms"], "ms", ISSUE),
    }
    return figures, {"available": True, **r}


# child ------------------------------------------------------------------------------------
def _child(model_path: str, n_new: int, n_prompts: int, sentences: int) -> dict:
    import time

    import numpy as np
    from PySide6.QtCore import QElapsedTimer, QEventLoop, QObject, Qt, QTimer, Slot
    from PySide6.QtWidgets import QApplication

    from app.settings import AppSettings
    from app.worker import EngineClient

    from ..scenario import SCENARIO_DIR, load_scenario

    class Ui(QObject):
        """The UI thread's receiver: a QObject here, so the worker's signals arrive queued."""

        def __init__(self):
            super().__init__()
            self.loop = QEventLoop()
            self.error: str | None = None
            self.loaded = self.done = False
            self.pieces = self.finished = 0
            self.ticks: list[int] = []
            self.clock = QElapsedTimer()

        @Slot()
        def tick(self):
            self.ticks.append(self.clock.nsecsElapsed())

        @Slot(str)
        def fail(self, msg):
            self.error = msg
            self.loop.quit()

        @Slot(str, str)
        def refused(self, tag, why):
            self.fail(f"request {tag} refused: {why}")

        @Slot(dict)
        def on_loaded(self, _info):
            self.loaded = True
            self.loop.quit()

        @Slot(list)
        def on_tokens(self, pieces):
            self.pieces += len(pieces)

        @Slot(object)
        def on_finished(self, _record):
            self.finished += 1

        @Slot()
        def on_run_finished(self):
            self.done = True
            self.loop.quit()

        @Slot()
        def timed_out(self):
            self.fail("timed out")

    app = QApplication.instance() or QApplication([])
    sc = load_scenario(os.path.join(SCENARIO_DIR, "eight_questions.json"))
    system = sc.system if not sentences else ". ".join(sc.system.split(". ")[:sentences]) + "."
    ui = Ui()
    client = EngineClient()
    w = client.worker
    w.model_loaded.connect(ui.on_loaded)
    w.model_load_failed.connect(ui.fail)
    w.failed.connect(ui.fail)
    w.request_refused.connect(ui.refused)
    w.token_generated.connect(ui.on_tokens)
    w.request_finished.connect(ui.on_finished)
    w.run_finished.connect(ui.on_run_finished)
    timer = QTimer()
    timer.setTimerType(Qt.TimerType.PreciseTimer)
    timer.setInterval(TICK_MS)
    timer.timeout.connect(ui.tick)
    guard = QTimer()
    guard.setSingleShot(True)
    guard.timeout.connect(ui.timed_out)
    try:
        guard.start(300_000)
        client.load_model(model_path)
        ui.loop.exec()  # the load signal is queued: it cannot arrive before this loop runs
        if ui.error or not ui.loaded:
            return {"error": ui.error or "the model did not load"}
        settings = AppSettings(max_streams=8, max_new_tokens=n_new, repeat_penalty=1.0)
        client.apply_settings(settings)
        jobs = [{"tag": client.new_tag(), "system": system, "user": q, "max_new_tokens": n_new,
                 "sampling": settings.sampling()} for q in sc.prompts[:n_prompts]]
        guard.start(550_000)
        ui.clock.start()
        t0 = time.perf_counter()
        timer.start()
        client.submit(jobs)
        ui.loop.exec()
        wall = time.perf_counter() - t0
        timer.stop()
    finally:
        client.shutdown()
    app.processEvents()
    if ui.error or not ui.done:
        return {"error": ui.error or "the run did not finish"}
    ticks = ui.ticks
    gaps = np.diff(np.asarray([0] + ticks, dtype=np.float64)) / 1e6  # ms; the first gap from the start
    return {"streams": len(jobs), "new_tokens": n_new, "system_chars": len(system), "wall_s": wall,
            "ticks": len(ticks),
            "max_gap_ms": float(gaps.max()), "p99_gap_ms": float(np.percentile(gaps, 99)),
            "mean_gap_ms": float(gaps.mean()), "tokens_received": ui.pieces, "finished": ui.finished}


def _main() -> int:
    if len(sys.argv) != 6 or sys.argv[1] != "--child":
        print("usage: python -m app.bench.ui --child MODEL NEW_TOKENS PROMPTS SYSTEM_SENTENCES (0: all)",
              file=sys.stderr)
        return 2
    try:
        result = _child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    except Exception as e:  # noqa: BLE001 - the parent reports it as "not available"
        result = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
