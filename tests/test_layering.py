"""Imports go one way (DESIGN §1): the engine never imports Qt, pyqtgraph, app or ui; ui never imports app."""

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


def _imports(path: str) -> list[tuple[int, str]]:
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), filename=path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                found.append((node.lineno, node.module))
            elif node.level >= 2:  # `from ..app import x` climbs out of engine/
                found.append((node.lineno, (node.module or "").split(".")[0] or ".."))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            found.append((node.lineno, str(node.args[0].value)))
    return found


def _offenders(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    files = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs if f.endswith(".py")]
    assert len(files) >= 8, folder
    return [f"{os.path.relpath(path, ROOT)}:{line} imports {name}"
            for path in files for line, name in _imports(path)
            if _top(name) in forbidden or name == ".."]


def test_no_engine_file_imports_gui_or_app():
    offenders = _offenders(ENGINE, FORBIDDEN)
    assert not offenders, "\n".join(offenders)


def test_no_ui_file_imports_app():
    # widgets take plain data; app/ wires them to the worker, settings and reports
    offenders = _offenders(UI, ("app",))
    assert not offenders, "\n".join(offenders)


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
                   "from ..ui import window\nimport importlib\nimportlib.import_module('app.gui')\n")
    names = [n for _, n in _imports(str(src))]
    assert {"PySide6.QtCore", "pyqtgraph", "ui", "app.gui"} <= set(names)
