"""Bench section "Trace replay": the shipped Mooncake trace through the engine's cache, and a sweep.

One configuration (leaf-LRU at infinite capacity and at 10,000 blocks) in this
process, then 6 capacities x 3 policies in a process pool: its wall time, the CPU
time its worker processes used, and so how many cores the sweep kept busy.
"""

from __future__ import annotations

import os
import resource
import tempfile
import time

from app.replay.results import ReplayConfig
from app.replay.simulate import replay
from app.replay.sweep import configurations, run_sweep
from app.replay.trace import open_trace
from app.replay.whatif import COMPARED_POLICIES

from .common import REPO_ROOT, figure, target

FEATURE = "trace replay"  # the table's and the JSON's "feature" of its figures
TRACE = os.path.join(REPO_ROOT, "resources", "traces", "mooncake", "conversation_trace.jsonl")
SWEEP_BUDGETS = (None, 100_000, 30_000, 10_000, 3_000, 1_000)
SWEEP_POLICIES = COMPARED_POLICIES
QUICK_REQUESTS, QUICK_BUDGETS, QUICK_POLICIES = 1000, (None, 3_000), COMPARED_POLICIES[:2]


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def replay_figures(quick: bool) -> tuple[dict, dict]:
    with tempfile.TemporaryDirectory(prefix="prefixlab-bench-replay-") as tmp:
        path = TRACE
        if quick:  # the trace's first requests: seconds, not comparable with the target
            path = os.path.join(tmp, "head.jsonl")
            with open(TRACE, encoding="utf-8") as src, open(path, "w", encoding="utf-8") as dst:
                for _, line in zip(range(QUICK_REQUESTS), src):
                    dst.write(line)
        src = open_trace(path)
        one = {}
        for budget in (None, 10_000):
            t0 = time.perf_counter()
            r = replay(src, ReplayConfig(budget=budget))
            one[budget] = (time.perf_counter() - t0, r)
        configs = configurations([None], QUICK_BUDGETS if quick else SWEEP_BUDGETS,
                                 QUICK_POLICIES if quick else SWEEP_POLICIES)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        cpu0, t0 = _children_cpu_s(), time.perf_counter()
        results = run_sweep(src, configs, workers=cores)
        wall = time.perf_counter() - t0
        cpu = _children_cpu_s() - cpu0  # the pool's workers have exited: their CPU is counted
    inf_s, inf_r = one[None]
    bounded_s, bounded_r = one[10_000]
    serial = sum(r.seconds for r in results)
    busy = min(cores, len(configs))  # processes the pool ran
    figures = {
        "replay_one_config_s": figure(inf_s, "s", FEATURE, **target("replay_one_config_s"),
                                      note=f"leaf-LRU, infinite capacity, {inf_r.requests:,} requests; "
                                           f"token hit ratio {inf_r.token_hit_ratio:.4f}"),
        "replay_10k_blocks_s": figure(bounded_s, "s", FEATURE, **target("replay_10k_blocks_s"),
                                      note=f"leaf-LRU at 10,000 blocks; token hit ratio "
                                           f"{bounded_r.token_hit_ratio:.4f}, {bounded_r.evicted:,} evicted"),
        "replay_sweep_wall_s": figure(wall, "s", FEATURE,
                                      note=f"{len(configs)} configurations (capacities x policies) "
                                           f"in {busy} processes"),
        "replay_sweep_core_share": figure(cpu / (wall * busy) if wall else None, "of cores", FEATURE,
                                          **target("replay_sweep_core_share"),
                                          note=f"worker CPU {cpu:.1f} s / (wall {wall:.1f} s x {busy} "
                                               f"processes); {cores} usable cores"),
    }
    details = {"trace": path if not quick else f"first {QUICK_REQUESTS} requests of {TRACE}",
               "cores": cores, "sweep_cpu_s": cpu, "sweep_serial_s": serial,
               "rows": [r.to_json() | {"over_time": None} for r in results]}
    return figures, details
