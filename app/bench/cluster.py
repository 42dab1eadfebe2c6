"""Bench section "Clusters": the Mooncake trace over 1-8 replicas x six routers, and a million requests.

The full conversation trace x 6 routers x 4 replica counts (3,000 blocks each) runs
in a process pool and on a Dask LocalCluster of as many worker processes: both wall
times, and whether every number matched. Then a 1,000,000-request synthetic trace
(`prefixlab replay --synthesize`) replays at one setting in a child process, whose
peak RSS is the figure: the trace streams, so memory stays bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from app.replay.cluster import ClusterConfig, ServiceModel, replay_cluster
from app.replay.cluster_cli import cluster_configs
from app.replay.routers import ROUTERS, RouterKnobs
from app.replay.sweep import run_sweep
from app.replay.trace import open_trace

from .common import child_env, figure, peak_rss_mb, target
from .replay import QUICK_REQUESTS, TRACE

FEATURE = "clusters"  # the table's and the JSON's "feature" of its figures
REPLICAS, BUDGET = (1, 2, 4, 8), 3_000
QUICK_REPLICAS = (2, 4)  # --quick: half the configurations (seconds, for tests)
# A GPU-class replica (the README's table): this trace's 41k prompt tokens/s need 4 or more.
SERVICE = ServiceModel(prefill_rate=10_000.0, decode_rate=30.0, slots=16)
BIG_REQUESTS, QUICK_BIG_REQUESTS = 1_000_000, 5_000
BIG_SETTING = ClusterConfig(4, "cache-aware", SERVICE, budget=BUDGET)


def _numbers(results) -> list[tuple]:
    return [(r.replicas, r.router, r.tokens_saved, r.load_imbalance, r.ttft_p50_s, r.ttft_p99_s,
             r.per_replica) for r in results]


def cluster_figures(quick: bool) -> tuple[dict, dict]:
    from dask.distributed import LocalCluster
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="prefixlab-bench-cluster-") as tmp:
        path = TRACE
        if quick:
            path = os.path.join(tmp, "head.jsonl")
            with open(TRACE, encoding="utf-8") as src, open(path, "w", encoding="utf-8") as dst:
                for _, line in zip(range(QUICK_REQUESTS), src):
                    dst.write(line)
        src = open_trace(path)
        replicas = QUICK_REPLICAS if quick else REPLICAS
        configs = cluster_configs(replicas, ROUTERS, [BUDGET], ["leaf-lru"], [None], SERVICE, RouterKnobs())
        t0 = time.perf_counter()
        pool = run_sweep(src, configs, workers=cores, fn=replay_cluster)
        pool_s = time.perf_counter() - t0
        with LocalCluster(n_workers=cores, threads_per_worker=1, processes=True,
                          dashboard_address=":0") as lc:
            t0 = time.perf_counter()
            dask = run_sweep(src, configs, dask_scheduler=lc.scheduler_address, fn=replay_cluster)
            dask_s = time.perf_counter() - t0
        same = _numbers(pool) == _numbers(dask)
        big = _big_trace(tmp, QUICK_BIG_REQUESTS if quick else BIG_REQUESTS)
    n = len(configs)
    figures = {
        "cluster_sweep_dask_s": figure(dask_s, "s", FEATURE, note=f"{n} configurations (replicas x routers, "
                                       f"{BUDGET:,} blocks each) on a LocalCluster of {cores} processes"),
        "cluster_sweep_pool_s": figure(pool_s, "s", FEATURE, note=f"the same in a pool of {cores} processes"),
        "cluster_dask_matches_pool": figure(1.0 if same else 0.0, "bool", FEATURE,
                                            **target("cluster_dask_matches_pool"),
                                            note="every hit ratio, imbalance and TTFT equal"),
        "cluster_1m_peak_rss_gb": figure(big["peak_rss_mb"] / 1000, "GB", FEATURE,
                                         **target("cluster_1m_peak_rss_gb"),
                                         note=f"{big['requests']:,} synthetic requests, 4 replicas, "
                                              f"cache-aware, {BUDGET:,} blocks each, "
                                              f"in {big['seconds']:.0f} s (child process)"),
    }
    details = {"trace": path, "cores": cores, "service": SERVICE.__dict__, "big": big,
               "rows": [r.to_json() for r in pool]}
    return figures, details


def _big_trace(tmp: str, n: int) -> dict:
    from app.replay.synth import synthesize
    path = os.path.join(tmp, "synthetic.jsonl")
    synthesize(n, path, seed=0)
    out = subprocess.run([sys.executable, "-m", "app.bench.cluster", path], capture_output=True, text=True,
                         env=child_env(), timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"the big replay's child failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _child(path: str) -> dict:
    """Replay `path` at BIG_SETTING; report this process's peak RSS."""
    t0 = time.perf_counter()
    r = replay_cluster(open_trace(path), BIG_SETTING)
    return {"requests": r.requests, "token_hit_ratio": r.token_hit_ratio, "ttft_p99_s": r.ttft_p99_s,
            "seconds": time.perf_counter() - t0,
            "peak_rss_mb": peak_rss_mb()}  # VmHWM: ru_maxrss would carry over the bench's own peak


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1])))
