"""The desktop's engine thread (app/desktop/engine_driver.py): requests from the UI thread run on
it, what the engine says comes back in the order it was said, a failing request leaves the
thread alive, and shutting down twice is safe."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import threading  # noqa: E402

from app.desktop.desktop_engine import (  # noqa: E402
    Failed,
    KvBudget,
    ModelLoaded,
    ProbeReady,
    RunFinished,
    SchedulerReset,
)
from app.desktop.engine_driver import EngineDriver  # noqa: E402
from app.desktop.settings import AppSettings  # noqa: E402
from engine import SamplingParams  # noqa: E402
from engine.loop import Accepted  # noqa: E402
from engine.scheduler import FinishEvent, TokenEvent  # noqa: E402

SYSTEM = "You help at a hardware store that sells drills, saws, screws and paint."


def on_thread(calls: dict, name: str, fn):
    """`fn`, noting the thread each call runs on under `name`."""
    def noted(*args):
        calls.setdefault(name, set()).add(threading.get_ident())
        return fn(*args)
    return noted


def test_requests_run_on_the_engine_thread_and_answers_come_back_in_order(qtbot, tiny_gguf_path):
    driver = EngineDriver()
    calls: dict = {}  # engine method -> the threads it ran on
    for name in ("load_model", "probe", "step"):
        setattr(driver.engine, name, on_thread(calls, name, getattr(driver.engine, name)))
    heard: list = []  # every report and every (ticket, event), in the order they came
    driver.reported.connect(heard.append)
    driver.job_events.connect(heard.extend)
    try:
        driver.apply_settings(AppSettings(page_rows=4, max_streams=2))
        driver.load_model(tiny_gguf_path)
        qtbot.waitUntil(lambda: any(isinstance(r, ModelLoaded) for r in heard), timeout=60_000)
        kinds = [type(r) for r in heard]
        # the new pool is announced before the model that needed it
        assert kinds.index(KvBudget) < kinds.index(SchedulerReset) < kinds.index(ModelLoaded)

        ticket = driver.submit({"system": SYSTEM, "user": "Do you sell drills?", "max_new_tokens": 3,
                                "sampling": SamplingParams(temperature=0.0)})
        qtbot.waitUntil(lambda: any(isinstance(r, RunFinished) for r in heard), timeout=60_000)
        run = heard[kinds.index(ModelLoaded) + 1:]
        events = [r for r in run if isinstance(r, tuple)]
        assert isinstance(events[0][1], Accepted) and isinstance(events[-1][1], FinishEvent)
        assert {t for t, _ in events} == {ticket} and any(isinstance(ev, TokenEvent) for _, ev in events)
        assert run.index(events[-1]) < next(i for i, r in enumerate(run) if isinstance(r, RunFinished))

        # a request that raises is reported and the thread lives on: the next one is answered
        driver.apply_settings(AppSettings(page_rows=0))
        driver.probe(SYSTEM, "Do you sell saws?")
        qtbot.waitUntil(lambda: any(isinstance(r, ProbeReady) for r in heard), timeout=30_000)
        failed = [r for r in heard if isinstance(r, Failed)]
        assert len(failed) == 1 and "Page rows" in failed[0].message
        assert driver.thread.isRunning()
        # the requests and the steps all ran on one thread, never the UI's
        threads = set().union(*calls.values())
        assert sorted(calls) == ["load_model", "probe", "step"] and len(threads) == 1
        assert threading.get_ident() not in threads
    finally:
        driver.shutdown()
    assert not driver.thread.isRunning()
    driver.shutdown()  # a second time: nothing to do
