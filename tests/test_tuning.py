"""engine.tune_process(): `import engine` changes nothing, and every front end tunes the process
before NumPy loads OpenBLAS (engine/tuning.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str, *args: str, env: dict | None = None) -> str:
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**(env or os.environ), "QT_QPA_PLATFORM": "offscreen"})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_importing_engine_changes_nothing_until_the_process_is_tuned():
    code = textwrap.dedent("""
        import ctypes, json, os, sys
        before = dict(os.environ)
        import engine
        quiet = {"environ": dict(os.environ) == before, "numpy": "numpy" in sys.modules}
        engine.tune_process()
        engine.tune_process()   # idempotent
        after = {k: v for k, v in os.environ.items() if before.get(k) != v}
        print(json.dumps({**quiet, "after": after}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    got = json.loads(_run(code, env=env))
    assert got == {"environ": True, "numpy": False, "after": {"OPENBLAS_THREAD_TIMEOUT": "22"}}


def test_a_timeout_the_user_set_wins():
    code = "import engine, os; engine.tune_process(); print(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    assert _run(code, env={**os.environ, "OPENBLAS_THREAD_TIMEOUT": "8"}) == "8"


def test_every_front_end_tunes_the_process_before_numpy_loads_openblas():
    """OpenBLAS's idle threads spin ~0.1 s after a threaded call, on the core a helper process
    needs; tune_process() shortens that, but OpenBLAS reads it only when NumPy loads it, so every
    command's entry point calls it before anything imports NumPy."""
    from app.cli import COMMANDS

    code = textwrap.dedent("""
        import json, os, sys
        seen = {}
        class Watch:
            def find_spec(self, name, path=None, target=None):
                if name == "numpy" and "at" not in seen:
                    seen["at"] = os.environ.get("OPENBLAS_THREAD_TIMEOUT")
        sys.meta_path.insert(0, Watch())
        from app.cli import main
        try:
            main(sys.argv[1:] + ["--help"])
        except SystemExit:
            pass
        import numpy
        print(json.dumps(seen.get("at")))
    """)
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    for command in [*COMMANDS, None]:  # None: `prefixlab` alone, the desktop app
        got = _run(code, *([command] if command else []), env=env)
        assert got == '"22"', f"prefixlab {command or ''} loads NumPy before tuning the process"
