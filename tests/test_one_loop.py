"""One door into the engine: a prompt typed in the window, an HTTP request and `prefixlab run` all
reach the scheduler through the same `EngineLoop.submit`, and nothing else submits."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import ast  # noqa: E402
import pathlib  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402
from PySide6.QtCore import Qt  # noqa: E402

from app import cli  # noqa: E402
from engine.loop import EngineLoop  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402
from tests.gui_helpers import LOAD_TIMEOUT_MS, set_settings  # noqa: E402
from tests.serve_helpers import scheduler_on, start_server  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def doors(monkeypatch):
    """Every job that entered an EngineLoop, and how many requests reached a Scheduler."""
    seen = {"jobs": [], "scheduler_submits": 0}
    loop_submit, sched_submit = EngineLoop.submit, Scheduler.submit

    def spy_loop(self, job):
        seen["jobs"].append(job)
        return loop_submit(self, job)

    def spy_sched(self, request):
        seen["scheduler_submits"] += 1
        return sched_submit(self, request)

    monkeypatch.setattr(EngineLoop, "submit", spy_loop)
    monkeypatch.setattr(Scheduler, "submit", spy_sched)
    return seen


def test_window_http_and_run_go_through_the_one_loop(doors, open_desktop, qtbot, tiny_gguf_path, tiny_model,
                                                      capsys):
    # 1. typed in the window
    d = open_desktop(autoload=True, model_path=tiny_gguf_path)
    d.window.show()
    c = d.controller
    qtbot.waitUntil(lambda: c.model_info is not None, timeout=LOAD_TIMEOUT_MS)
    set_settings(d, max_new_tokens=3)
    qtbot.keyClicks(d.window.prompt_list.entry, "hello window")
    qtbot.keyClick(d.window.prompt_list.entry, Qt.Key.Key_Return)
    d.window.act_run_all.trigger()
    qtbot.waitUntil(lambda: len(c.finished_records) == 1, timeout=60_000)
    typed = doors["jobs"][-1]
    assert typed.client == "" and typed.request_id == c.finished_records[0].id
    assert c.finished_records[0].finish_reason

    # 2. an HTTP request
    server = start_server(scheduler_on(tiny_model))
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello http", "max_tokens": 3},
                       timeout=60)
        assert r.status_code == 200, r.text
    finally:
        server.stop()
    served = doors["jobs"][-1]
    assert served.client.startswith("http ") and served.request_id is not None

    # 3. prefixlab run
    assert cli.main(["run", "--model", tiny_gguf_path, "--prompt", "hello run", "--max-new", "3"]) == 0
    assert "1 requests in" in capsys.readouterr().out
    scripted = doors["jobs"][-1]
    assert scripted.client == "" and scripted.request_id is not None

    # One door: each front end's job entered an EngineLoop, and the scheduler saw no other request.
    assert {type(j) for j in (typed, served, scripted)} == {type(typed)}
    assert doors["scheduler_submits"] == len(doors["jobs"]) == 3


def _foreign_private_access(path: pathlib.Path) -> list[str]:
    """`obj._name` where obj is not self/cls: a reach into another object's insides."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    return out


def test_front_ends_use_named_calls_not_the_schedulers_insides():
    found = [hit for d in ("app", "ui", "tools") for p in sorted((ROOT / d).rglob("*.py"))
             for hit in _foreign_private_access(p)]
    assert not found, "reaches into another object's private state:\n" + "\n".join(found)


def test_only_the_engine_loop_submits_to_a_scheduler():
    """Front ends hand the loop jobs; `Scheduler.submit` is called from engine/loop.py alone."""
    callers = []
    for d in ("app", "ui", "tools", "engine"):
        for p in sorted((ROOT / d).rglob("*.py")):
            if p.name == "loop.py" and p.parent.name == "engine":
                continue
            for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr == "submit" and "sch" in ast.unparse(node.func.value).lower():
                    callers.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not callers, callers


def test_a_job_that_breaks_its_own_submit_fails_alone_and_the_loop_goes_on(tiny_model):
    from engine.loop import Accepted, Job, Refused
    from engine.scheduler import FinishEvent

    loop = EngineLoop(tiny_model)
    answers: dict[str, list] = {"bad": [], "good": []}
    # A lone surrogate cannot be encoded: the tokenizer raises inside this job's submit.
    loop.submit(Job({"messages": [{"role": "user", "content": "x\ud800y"}]}, answers["bad"].append))
    loop.submit(Job({"user": "hello", "max_new_tokens": 2}, answers["good"].append))
    loop.run_until_done()
    (bad,) = answers["bad"]
    assert isinstance(bad, Refused) and bad.status in (400, 500) and bad.message
    assert isinstance(answers["good"][0], Accepted) and isinstance(answers["good"][-1], FinishEvent)
    assert loop.in_flight() == 0 and not loop.scheduler.has_work()


def test_the_prefixlab_command_opens_the_window_and_the_tour(qapp, gui_settings, tiny_gguf_path):
    """`prefixlab` (run_app): the window comes up on a first start with the tour's first step,
    and closing it ends the app with its engine thread."""
    import signal

    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    from app.desktop.gui import run_app
    from ui.main_window import MainWindow
    from ui.tour_panel import TourPanel

    seen: list = []

    def look_and_close() -> None:
        windows = [w for w in QApplication.topLevelWidgets() if isinstance(w, MainWindow) and w.isVisible()]
        if not windows:
            QTimer.singleShot(100, look_and_close)
            return
        tours = windows[0].findChildren(TourPanel)
        seen.append((windows[0], any(t.isVisible() for t in tours)))
        windows[0].close()

    before = signal.getsignal(signal.SIGINT)
    QTimer.singleShot(200, look_and_close)
    try:
        assert run_app(tiny_gguf_path) == 0
    finally:
        signal.signal(signal.SIGINT, before)
    assert seen and seen[0][1], "the window and the tour's first step were on screen"
