"""This machine's CPU and NumPy's BLAS, read once here for the layout probe, reports and the bench."""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_runtime() -> dict:
    """The BLAS NumPy loaded, as threadpoolctl finds it: library, version, threads, core type."""
    import numpy  # noqa: F401 - threadpoolctl sees only libraries already loaded
    from threadpoolctl import threadpool_info

    for info in threadpool_info():
        if info.get("user_api") == "blas":
            return {"library": info.get("filepath"), "api": info.get("internal_api"),
                    "version": info.get("version"), "threads": info.get("num_threads"),
                    "core": info.get("architecture")}
    return {}
