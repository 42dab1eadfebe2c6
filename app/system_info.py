"""Versions and machine facts, defined once for reports, the bench and the About box."""

from __future__ import annotations

import os
import platform
from importlib import metadata

from engine.machine import blas_runtime, cpu_model  # noqa: F401 - defined once, in the engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Distributions whose versions a report records (PySide6 under either wheel name, below).
VERSIONED = ("numpy", "gguf", "tokenizers", "jinja2", "pyqtgraph")


def cpu_isa() -> str | None:
    """The widest x86 vector ISA the CPU offers ("AVX-512", "AVX2", "AVX"), from /proc/cpuinfo's flags."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            flags = next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
    except OSError:
        return None
    for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX")):
        if flag in flags:
            return name
    return None


def dist_version(*names: str) -> str | None:
    """The installed version of the first of these distributions that is installed, else None."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def prefixlab_version() -> str | None:
    """The installed distribution's version, else pyproject.toml's (a source checkout), else None."""
    v = dist_version("prefixlab")
    if v is not None:
        return v
    try:
        import tomllib
        with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
            return str(tomllib.load(fh)["project"]["version"])
    except (OSError, KeyError, ValueError):
        return None


def versions() -> dict[str, str | None]:
    """Versions of PrefixLab and the libraries it runs on (None: not installed); imports no Qt."""
    out = {"prefixlab": prefixlab_version()}
    out.update({name: dist_version(name) for name in VERSIONED})
    out["PySide6"] = dist_version("PySide6-Essentials", "PySide6")
    return out


def machine() -> dict:
    """Where this runs: platform, machine, processor, CPU count, Python and its implementation."""
    return {"platform": platform.platform(), "machine": platform.machine(),
            "processor": platform.processor(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "python_implementation": platform.python_implementation()}


def about_versions() -> dict[str, str]:
    """The About box's table: display name -> version."""
    from PySide6 import QtCore

    v, m = versions(), machine()
    names = {"PySide6": "PySide6", "pyqtgraph": "pyqtgraph", "gguf": "gguf", "tokenizers": "tokenizers",
             "jinja2": "Jinja2"}
    return {"PrefixLab": v["prefixlab"] or "unknown",
            "Python": f"{m['python']} ({m['python_implementation']})",
            "NumPy": v["numpy"] or "not installed", "Qt": QtCore.qVersion(),
            **{shown: v[key] or "not installed" for key, shown in names.items()},
            "Platform": f"{platform.system()} {m['machine']}"}
