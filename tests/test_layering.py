"""Imports go one way (docs/design.md §1). The engine is a library: it imports only the standard library,
numpy, gguf, tokenizers, jinja2 and threadpoolctl, never Qt, pyqtgraph, app or ui; ui never imports app."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = os.path.join(ROOT, "engine")
UI = os.path.join(ROOT, "ui")
FORBIDDEN = ("PySide6", "pyqtgraph", "app", "ui", "PyQt5", "PyQt6", "shiboken6")
# Besides the standard library, the engine may import only these (docs/design.md §1, issue 10).
ENGINE_ALLOWED = ("numpy", "gguf", "tokenizers", "jinja2", "threadpoolctl")


def _top(name: str) -> str:
    return name.split(".")[0]


def test_importing_engine_loads_no_gui_or_app_module():
    code = ("import json, sys; import engine; import engine.api, engine.model, engine.loader; "
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "engine" in loaded and "numpy" in loaded
    bad = sorted(m for m in loaded if _top(m) in FORBIDDEN)
    assert not bad, f"importing engine loaded {bad}"


def test_the_command_line_loads_no_server_or_gui_stack_until_asked():
    # `prefixlab run` starts in well under a second only while the parser stays light:
    # FastAPI alone took 0.4 s of every headless run's start
    code = ("import json, sys; from app.cli import build_parser; build_parser(); "
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    loaded = {_top(m) for m in json.loads(out.stdout.strip().splitlines()[-1])}
    assert not loaded & {"fastapi", "starlette", "uvicorn", "pydantic", "PySide6", "pyqtgraph"}


def test_the_desktops_engine_side_loads_no_qt():
    # app/desktop/desktop_engine.py is the engine thread's work without its Qt driver: it is read
    # and tested (tests/test_desktop_engine.py) with no Qt at all
    code = ("import json, sys; import app.desktop.desktop_engine; "
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "app.desktop.desktop_engine" in loaded and "engine.loop" in loaded
    bad = sorted(m for m in loaded if _top(m) in ("PySide6", "shiboken6", "pyqtgraph", "ui"))
    assert not bad, f"importing the desktop's engine side loaded {bad}"


def test_prefixlab_run_imports_only_its_own_command():
    # every other command's parser pulls in its own stack (trace readers, the report, ZeroMQ)
    code = ("import json, sys; from app.cli import main; import app.run_headless as r; "
            "r.run = lambda args: 0; main(['--model', 'x', 'run', '--prompt', 'hi']); "
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "app.run_headless" in loaded
    others = {"app.replay.trace", "app.report", "app.serve.cli", "app.watch.cli", "app.bench", "zmq"}
    assert not loaded & others


def _imports(path: str, depth: int = 1) -> list[tuple[int, str]]:
    """(line, module) of every import in `path`, a module `depth` packages deep in the tree checked
    (engine/x.py: 1, engine/cpu/x.py: 2); a relative import that climbs out of it as ".."."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), filename=path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                found.append((node.lineno, node.module))
            elif node.level > depth:  # `from ..app import x` in engine/x.py climbs out of engine/
                found.append((node.lineno, (node.module or "").split(".")[0] or ".."))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            found.append((node.lineno, str(node.args[0].value)))
    return found


def import_offenders(root: str, allowed) -> list[str]:
    """Imports under `root` of a top-level name `allowed(name)` refuses, and any `..` climb out."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".py")]
    depth = {path: os.path.relpath(path, root).count(os.sep) + 1 for path in files}
    return [f"{os.path.relpath(path, ROOT)}:{line} imports {name}"
            for path in files for line, name in _imports(path, depth[path])
            if name == ".." or not allowed(_top(name))]


def engine_import_offenders(root: str) -> list[str]:
    """Imports under `root` of anything but the standard library and ENGINE_ALLOWED."""
    return import_offenders(root, lambda top: top in sys.stdlib_module_names or top in ENGINE_ALLOWED)


def ui_import_offenders(root: str) -> list[str]:
    """Imports of app/ under `root` (widgets take plain data; app/ wires them)."""
    return import_offenders(root, lambda top: top != "app")


def test_engine_imports_only_the_standard_library_and_its_few_dependencies():
    assert len([f for _, _, fs in os.walk(ENGINE) for f in fs if f.endswith(".py")]) >= 8
    offenders = engine_import_offenders(ENGINE)
    assert not offenders, "\n".join(offenders)


def test_the_engine_rule_catches_a_stray_dependency(tmp_path):
    (tmp_path / "ok.py").write_text("import os, json\nimport numpy as np\nfrom gguf import GGUFReader\n"
                                    "from .block_manager import BlockManager\nimport threadpoolctl\n")
    assert engine_import_offenders(str(tmp_path)) == []
    (tmp_path / "bad.py").write_text("import requests\nfrom PySide6 import QtCore\nimport app.cli\n")
    bad = engine_import_offenders(str(tmp_path))
    assert [b.rsplit(" ", 1)[1] for b in bad] == ["requests", "PySide6", "app.cli"]


def test_no_ui_file_imports_app():
    assert len([f for _, _, fs in os.walk(UI) for f in fs if f.endswith(".py")]) >= 8
    offenders = ui_import_offenders(UI)
    assert not offenders, "\n".join(offenders)


def test_the_ui_rule_catches_an_app_import(tmp_path):
    (tmp_path / "ok.py").write_text("from PySide6 import QtCore\nfrom engine.metrics import PAGE_FREE\n"
                                    "from .theme import icon\n")
    assert ui_import_offenders(str(tmp_path)) == []
    (tmp_path / "bad.py").write_text("from app.desktop.settings import AppSettings\nimport app\n")
    assert len(ui_import_offenders(str(tmp_path))) == 2


def test_importing_ui_loads_no_app_module():
    code = ("import json, sys, pkgutil, importlib, ui; "
            "[importlib.import_module('ui.' + m.name) for m in pkgutil.iter_modules(ui.__path__)]; "
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": ROOT, "QT_QPA_PLATFORM": "offscreen"})
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "ui.main_window" in loaded
    bad = sorted(m for m in loaded if _top(m) == "app")
    assert not bad, f"importing ui loaded {bad}"


def test_the_checker_sees_imports(tmp_path):
    # the AST walk must catch every spelling, or the test above proves nothing
    src = tmp_path / "probe.py"
    src.write_text("import os\nimport PySide6.QtCore\nfrom pyqtgraph import PlotWidget\n"
                   "from ..ui import window\nimport importlib\nimportlib.import_module('app.desktop.gui')\n")
    names = [n for _, n in _imports(str(src))]
    assert {"PySide6.QtCore", "pyqtgraph", "ui", "app.desktop.gui"} <= set(names)
    # one package deeper (engine/cpu/x.py), `..` is still engine/ and `...` climbs out of it
    src.write_text("from ..loader import Weights\nfrom ...app import cli\nfrom ... import ui\n")
    assert [n for _, n in _imports(str(src), depth=2)] == ["app", ".."]


# engine/'s classes: each keeps its state to itself (docs/design.md §1) ---------------------------
def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own(node: ast.expr) -> bool:
    """`self`, `cls` or `super()`: the object whose own private state a method may touch."""
    return (isinstance(node, ast.Name) and node.id in ("self", "cls")) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super")


def encapsulation_offenders(root: str) -> list[str]:
    """Under `root`: `x._name` (or `getattr(x, "_name")` and the like) where x is not self, cls
    or super() -- another object's private state -- and classes named `*Mixin` (state that a
    host class must provide unseen). A dunder (`__name__`) is public; a module's own private
    function, called by its bare name, is no attribute access and stays allowed."""
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".py"))
    bad = []
    for path in files:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), filename=path)
        where = os.path.relpath(path, ROOT)
        for node in sorted(ast.walk(tree), key=lambda n: getattr(n, "lineno", 0)):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Mixin"):
                bad.append(f"{where}:{node.lineno} class {node.name} is a mixin")
            elif isinstance(node, ast.Attribute) and _private(node.attr) and not _own(node.value):
                bad.append(f"{where}:{node.lineno} reads {ast.unparse(node)}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                  and _private(node.args[1].value) and not _own(node.args[0])):
                bad.append(f"{where}:{node.lineno} reads {ast.unparse(node)}")
    return bad


def test_no_engine_class_uses_another_objects_private_state_or_is_a_mixin():
    offenders = encapsulation_offenders(ENGINE)
    assert not offenders, "\n".join(offenders)


def test_the_encapsulation_rule_catches_private_reads_and_mixins(tmp_path):
    (tmp_path / "ok.py").write_text(
        "def _helper(x):\n    return x\n\n"
        "class Cache:\n    def __init__(self):\n        self._pages = {}\n"
        "    def size(self):\n        return _helper(len(self._pages)) + type(self).__name__.count('C')\n"
        "    @classmethod\n    def make(cls):\n        return cls._new()\n"
        "    def __repr__(self):\n        return super().__repr__() + super()._tag()\n")
    assert encapsulation_offenders(str(tmp_path)) == []
    (tmp_path / "bad.py").write_text(
        "class TierMixin:\n    pass\n\n"
        "class Cache:\n    def evict(self, pool):\n        pool._free.pop()\n"
        "        self.pool._refs[0] = 1\n        return getattr(pool, '_seqs')\n")
    bad = [b.split(" ", 1)[1] for b in encapsulation_offenders(str(tmp_path))]
    assert bad == ["class TierMixin is a mixin", "reads pool._free", "reads self.pool._refs",
                   "reads getattr(pool, '_seqs')"]


# app/'s rooms: which capability subpackage may import which (docs/design.md §1) -----------------
QT = ("PySide6", "pyqtgraph", "shiboken6", "ui")
DESKTOP = ("app.desktop",)  # the desktop app's room: controllers, the worker, settings, start-up
# room -> (modules it must not import, its files allowed Qt and ui anyway)
APP_RULES = {
    "app/kv_wire.py": (("app", "zmq") + QT, ()),  # the wire format alone: msgspec and the stdlib
    "app/serve": (("app.watch", "app.replay", "app.bench") + DESKTOP + QT, ()),
    "app/watch": (("app.serve", "app.replay", "app.report", "app.bench") + QT, ("gui.py", "ui_stall.py")),
    "app/replay": (("app.serve", "app.watch", "app.bench") + DESKTOP + QT, ("plot.py",)),
    "app/report": (("app.serve", "app.watch", "app.replay", "app.bench") + DESKTOP + QT,
                   ("figures.py", "render.py")),
}


def _module_of(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def absolute_imports(path: str) -> list[tuple[int, str]]:
    """Every module `path` imports, relative imports resolved against its package."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), filename=path)
    module = _module_of(path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                found.append((node.lineno, node.module or ""))
                continue
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
    return found


def room_offenders(room: str, forbidden: tuple[str, ...], qt_files: tuple[str, ...] = ()) -> list[str]:
    """Imports under `room` (a folder or one file) of a module in `forbidden` (or below one)."""
    path = os.path.join(ROOT, room)
    files = [path] if path.endswith(".py") else [
        os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".py")]
    bad = []
    for file in files:
        rules = forbidden if os.path.basename(file) not in qt_files else tuple(
            f for f in forbidden if f not in QT)
        where = os.path.relpath(file, ROOT)
        bad += [f"{where}:{line} imports {name}" for line, name in absolute_imports(file)
                if any(name == f or name.startswith(f + ".") for f in rules)]
    return bad


def test_app_subpackages_import_only_what_their_room_allows():
    for room, (forbidden, qt_files) in APP_RULES.items():
        assert os.path.exists(os.path.join(ROOT, room)), room
        offenders = room_offenders(room, forbidden, qt_files)
        assert not offenders, "\n".join(offenders)


def test_nothing_but_the_cli_imports_the_bench():
    offenders = [o for o in room_offenders("app", ("app.bench",)) + room_offenders("ui", ("app.bench",))
                 if not o.startswith(("app/bench/", "app/cli.py"))]
    assert not offenders, "\n".join(offenders)


def test_the_room_rule_resolves_relative_imports(tmp_path, monkeypatch):
    room = tmp_path / "app" / "watch"
    room.mkdir(parents=True)
    (room / "ok.py").write_text("from .state import EngineState\nfrom ..kv_wire import decode_batch\n")
    (room / "bad.py").write_text("from ..serve.kv_events import seq_bytes\nfrom PySide6 import QtCore\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    bad = room_offenders("app/watch", ("app.serve",) + QT)
    assert sorted(b.split(" imports ")[1] for b in bad) == ["PySide6", "app.serve.kv_events"]
