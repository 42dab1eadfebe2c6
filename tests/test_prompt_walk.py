"""docs/design.md §5's walk of one desktop prompt stays true: every `file:function` step it
names exists, a prompt run from its card calls each of them, and one id (the engine loop's
ticket) is the id at every hop, from the card to the loop, back through the job's sink to
the card."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import ast  # noqa: E402
import functools  # noqa: E402
import importlib  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402

from PySide6.QtCore import Qt  # noqa: E402

from engine.loop import Accepted  # noqa: E402
from engine.scheduler import FinishEvent, TokenEvent  # noqa: E402
from tests.gui_helpers import LOAD_TIMEOUT_MS, set_settings  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEP = re.compile(r"`([\w/]+\.py):([\w.]+)`")
RUN_TIMEOUT_MS = 60_000


def walk_text() -> tuple[str, str]:
    """The walk (up to the next section) and its numbered steps alone."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    start = text.index("**The walk of one desktop prompt.**")
    walk = text[start:text.index("\n## ", start)]
    numbered = "\n".join(re.findall(r"^\d+\. .*(?:\n {3}.*)*", walk, re.M))
    return walk, numbered


def steps(text: str) -> list[tuple[str, str]]:
    """Each `file:Qualified.name` the text names, in order, once."""
    return list(dict.fromkeys(STEP.findall(text)))


def defined(path: str, qualname: str) -> bool:
    """Whether the file defines the class or function `qualname` (Class.method for a method)."""
    body = ast.parse((ROOT / path).read_text(encoding="utf-8")).body
    for name in qualname.split("."):
        node = next((n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef))
                     and n.name == name), None)
        if node is None:
            return False
        body = node.body
    return True


def test_every_step_the_walk_names_exists_in_the_code():
    walk, numbered = walk_text()
    named = steps(walk)
    missing = [f"{p}:{q}" for p, q in named if not (ROOT / p).is_file() or not defined(p, q)]
    assert not missing, "docs/design.md §5's walk names steps the code does not have:\n" + "\n".join(missing)
    # the walk covers the whole way: card, loop, scheduler, sink, card again, in that order
    order = [f"{p}:{q}" for p, q in steps(numbered)]
    hops = ["app/desktop/window.py:Desktop.run_prompt", "app/desktop/engine_driver.py:EngineDriver.submit",
            "engine/loop.py:EngineLoop.submit", "app/desktop/engine_driver.py:EngineDriver._pump",
            "app/desktop/desktop_engine.py:DesktopEngine.step", "engine/scheduler.py:Scheduler.submit",
            "app/desktop/desktop_engine.py:DesktopEngine.job_event",
            "app/desktop/controller.py:Controller._on_job_events", "app/desktop/turns.py:TurnBook.close"]
    assert [h for h in order if h in hops] == hops, order


def _spy_on_functions(monkeypatch, named: list[tuple[str, str]], calls: list) -> None:
    """Wrap each function step (Class.method) so that a call records its name (any thread)."""
    for path, qualname in named:
        owner_name, _, attr = qualname.rpartition(".")
        if not owner_name:
            continue  # a class (the card): it is there, and its signal starts the walk
        module = importlib.import_module(path[:-3].replace("/", "."))
        owner = getattr(module, owner_name)
        real = getattr(owner, attr)

        def spy(*args, _real=real, _name=f"{path}:{qualname}", **kw):
            calls.append((_name, args))
            return _real(*args, **kw)

        monkeypatch.setattr(owner, attr, functools.wraps(real)(spy))


def test_one_prompt_walks_the_documented_path_under_one_ticket(monkeypatch, open_desktop, qtbot,
                                                                tiny_gguf_path):
    _, numbered = walk_text()
    named = steps(numbered)
    calls: list = []
    _spy_on_functions(monkeypatch, named, calls)  # before the app exists: its signals connect the spies

    d = open_desktop(autoload=True, model_path=tiny_gguf_path)
    d.window.show()
    c = d.controller
    qtbot.waitUntil(lambda: c.model_info is not None, timeout=LOAD_TIMEOUT_MS)
    set_settings(d, max_new_tokens=4)
    qtbot.keyClicks(d.window.prompt_list.entry, "hello walk")
    qtbot.keyClick(d.window.prompt_list.entry, Qt.Key.Key_Return)
    d.window.act_run_all.trigger()  # the first run makes the prompt's card
    qtbot.waitUntil(lambda: len(c.finished_records) == 1 and not c.running, timeout=RUN_TIMEOUT_MS)
    (uid,) = c.transcripts
    card = d.window.streams.card(uid)

    calls.clear()
    card.run_clicked.emit(uid)  # the card's Run
    qtbot.waitUntil(lambda: len(c.finished_records) == 2 and not c.running, timeout=RUN_TIMEOUT_MS)
    qtbot.waitUntil(lambda: any(n.endswith("Controller.flush_text") for n, _ in calls), timeout=5_000)

    called = {name for name, _ in calls}
    skipped = [f"{p}:{q}" for p, q in named if "." in q and f"{p}:{q}" not in called]
    assert not skipped, "the walk names steps a prompt never took:\n" + "\n".join(skipped)

    def args_of(step: str) -> list[tuple]:
        return [args for name, args in calls if name.endswith(step)]

    # card -> loop: the loop's ticket is the one the card's book filed the turn under
    (job,) = [args[1] for args in args_of("EngineLoop.submit")]
    ticket = job.ticket
    assert ticket > 0 and [args[2] for args in args_of("TurnBook.opened")] == [ticket]
    # loop -> sink: every event of the run came through the job's sink under that ticket
    heard = args_of("DesktopEngine.job_event")
    assert {args[1].ticket for args in heard} == {ticket}
    kinds = [type(args[2]) for args in heard]
    assert kinds[0] is Accepted and kinds[-1] is FinishEvent and TokenEvent in kinds
    # sink -> card: the window got the same events, in order, under the same ticket
    seen = [pair for args in args_of("Controller._on_job_events") for pair in args[1]]
    assert [t for t, _ in seen] == [ticket] * len(heard)
    assert [type(ev) for _, ev in seen] == kinds
    assert [args[1] for args in args_of("TurnBook.close")] == [ticket]
    # and the card shows the answer the finish recorded
    record = seen[-1][1].record
    pieces = "".join(ev.text for _, ev in seen if isinstance(ev, TokenEvent))
    t = c.transcripts[uid]
    assert record.id == job.request_id and record.text == pieces == t.turns[-1].answer
    assert not t.running and ticket not in c.book.open_tickets()
