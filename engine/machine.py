"""This machine's CPU and NumPy's BLAS, read once here for the layout probe, reports and the bench."""

from __future__ import annotations

import platform


def cpu_model(path: str = "/proc/cpuinfo") -> str:
    """The CPU's model name and x86 family/model numbers (/proc/cpuinfo), else what platform says.
    The numbers tell CPU generations apart where a VM names them all alike ("AMD EPYC": Zen 4 is
    family 25, Zen 5 26), and the layout probe's measurement is kept per CPU (engine/cpu/weight_layout.py)."""
    fields: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if not key.strip():
                    break  # the first CPU's fields end at its blank line
                fields.setdefault(key.strip().lower(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


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
