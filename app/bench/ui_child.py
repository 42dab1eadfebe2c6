"""The "desktop app" bench child: the eight-question scenario in the real window and headless.

One process (QT_QPA_PLATFORM=offscreen) loads the model twice: once for the headless path
(`prefixlab run`'s: a Scheduler, submit every prompt, `run_until_done`) and once in the real
app (Desktop: controller, worker thread, the MainWindow shown with its charts and cache panel
refreshing as a user sees them). Both use the app's default settings and the scenario's
max_new_tokens, and start each round with an empty prefix cache. Rounds alternate headless /
app so a machine whose load drifts hurts both alike; a 10 ms QTimer on the UI thread records
the longest gap between its ticks during each app round. With `--busy` the same rounds run
again while one bounded busy-loop process takes a core.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

TICK_MS = 10

class _AppRunner:
    """The real Desktop, offscreen, with a tick timer on the UI thread."""

    def __init__(self, model_path: str, scenario, store_path: str):
        from PySide6.QtCore import QElapsedTimer, QEventLoop, QSettings, Qt, QTimer

        from app.desktop.gui import make_app
        from app.desktop.window import Desktop

        self.app = make_app([])
        self.loop = QEventLoop()
        self.error: str | None = None
        self.scenario = scenario
        store = QSettings(store_path, QSettings.Format.IniFormat)
        self.desktop = Desktop(model_path=model_path, autoload=False, store=store)
        self.window = self.desktop.window
        self.window.resize(1400, 900)
        self.window.show()
        c = self.desktop.controller
        c.model_loaded.connect(lambda _info: self.loop.quit())
        c.model_failed.connect(lambda: self._fail("the model did not load"))
        c.error.connect(lambda title, msg: self._fail(f"{title}: {msg}"))
        c.run_done.connect(self.loop.quit)
        c.cache_flushed.connect(self.loop.quit)
        self.clock = QElapsedTimer()
        self.ticks: list[int] = []
        self.timer = QTimer()
        self.timer.setTimerType(Qt.TimerType.PreciseTimer)
        self.timer.setInterval(TICK_MS)
        self.timer.timeout.connect(lambda: self.ticks.append(self.clock.nsecsElapsed()))
        self.guard = QTimer()
        self.guard.setSingleShot(True)
        self.guard.timeout.connect(lambda: self._fail("timed out"))
        self._wait(lambda: self.desktop.load_model(model_path), 300)
        self.desktop.load_scenario(scenario)

    def _fail(self, msg: str) -> None:
        self.error = self.error or msg
        self.loop.quit()

    def _wait(self, start, seconds: float) -> None:
        self.guard.start(int(seconds * 1000))
        start()
        self.loop.exec()
        self.guard.stop()
        if self.error:
            raise RuntimeError(self.error)

    def run_once(self) -> dict:
        """Empty the cache, run every prompt, return wall seconds and the UI's longest stall."""
        self._wait(self.desktop.controller.flush_cache, 60)
        self.ticks.clear()
        self.clock.start()
        self.timer.start()
        t0 = time.perf_counter()
        self._wait(self.desktop.run_all, 550)
        wall = time.perf_counter() - t0
        self.timer.stop()
        ticks = [0, *self.ticks, self.clock.nsecsElapsed()]
        gaps = [(b - a) / 1e6 for a, b in zip(ticks, ticks[1:], strict=False)]
        recs = self.desktop.controller.finished_records[-len(self.scenario.prompts):]
        return {"wall_s": wall, "max_gap_ms": max(gaps), "ticks": len(self.ticks),
                "tokens": sum(r.n_gen for r in recs), "chart_frames": self.window.charts.frames}

    def close(self) -> None:
        self.desktop.shutdown()
        self.window.close()
        self.app.processEvents()


class _Headless:
    """`prefixlab run`'s path on the same scenario and settings."""

    def __init__(self, model_path: str, scenario, settings):
        import engine
        from engine.loop import EngineLoop

        self.model = engine.load_model(model_path or None)
        self.loop = EngineLoop(self.model, settings.scheduler_settings(self.model))  # the app's KV budget too
        self.sch = self.loop.scheduler
        self.sampling = settings.sampling()
        self.scenario = scenario

    def run_once(self) -> dict:
        from app.desktop.blas_share import release_core

        sch, sc = self.sch, self.scenario
        release_core()  # the app's worker left a core for the UI; `prefixlab run` uses them all
        sch.flush_cache()
        t0 = time.perf_counter()
        ids = [self.loop.submit_now(system=sc.system, user=p, sampling=self.sampling,
                                    max_new_tokens=sc.max_new_tokens) for p in sc.prompts]
        self.loop.run_until_done()
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "tokens": sum(sch.record(i).n_gen for i in ids)}


def _rounds(app: _AppRunner, headless: _Headless, n: int) -> dict:
    heads, apps = [], []
    for _ in range(n):
        heads.append(headless.run_once())
        apps.append(app.run_once())
    ratios = [a["wall_s"] / h["wall_s"] for a, h in zip(apps, heads, strict=True)]
    return {"headless_s": statistics.median(h["wall_s"] for h in heads),
            "app_s": statistics.median(a["wall_s"] for a in apps),
            "ratio": statistics.median(ratios), "ratios": ratios,
            "max_gap_ms": statistics.median(a["max_gap_ms"] for a in apps),
            "max_gap_ms_each": [a["max_gap_ms"] for a in apps],
            "headless": heads, "app": apps}


def child(model_path: str, quick: bool, rounds: int, busy: bool) -> dict:
    from app.desktop.settings import AppSettings
    from app.scenario import SCENARIO_DIR, load_scenario

    sc = load_scenario(os.path.join(SCENARIO_DIR, "eight_questions.json"))
    if quick:  # two prompts, two tokens: the figures exist, nothing more
        sc.prompts, sc.max_new_tokens = sc.prompts[:2], 2
    settings = AppSettings.from_dict({**AppSettings().to_dict(), "max_new_tokens": sc.max_new_tokens})
    with tempfile.TemporaryDirectory(prefix="prefixlab-bench-ui-") as tmp:
        app = _AppRunner(model_path, sc, os.path.join(tmp, "settings.ini"))
        try:
            headless = _Headless(model_path, sc, settings)
            if not quick:  # first passes fault the weight image in: keep them out of the figures
                headless.run_once()
                app.run_once()
            out = {"prompts": len(sc.prompts), "new_tokens": sc.max_new_tokens, "rounds": rounds,
                   "idle": _rounds(app, headless, rounds)}
            if busy:
                from app.bench.w8 import busy_processes
                with busy_processes(1):
                    out["busy"] = _rounds(app, headless, rounds)
        finally:
            app.close()
    return out


def main() -> int:
    import engine
    engine.tune_process()  # NumPy is loaded: OpenBLAS has its timeout from the parent's environment
    if len(sys.argv) != 5:
        print("usage: python -m app.bench.ui_child MODEL QUICK(0/1) ROUNDS BUSY(0/1)", file=sys.stderr)
        return 2
    try:
        result = child(sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4] == "1")
    except Exception as e:  # noqa: BLE001 - the parent reports it as "not available"
        import traceback
        result = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=8)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
