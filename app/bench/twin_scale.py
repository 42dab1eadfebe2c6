"""Bench figures of the twin at scale (issue #48, "bounded"): requests per second of wall time
and peak RSS of a long synthetic trace through one twin replica, in a child process of its own
(so the peak is the twin's, not the bench's), with the peak RSS read at the first progress
call from a quarter of the way on and at the end: flat memory reads the same twice. Timing
belongs here, not in tests
(tests/test_twin_bounded.py counts what the twin retains instead).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from .common import child_env, figure

FEATURE = "twin"  # the table's and the JSON's "feature" of its figures
REQUESTS, QUICK_REQUESTS = 10_000, 2_000  # progress comes every 1,000 requests
POOL_PAGES = 8192   # a bounded pool (a real server's): the cache evicts, memory stays flat
# A replica that keeps up with the synthetic trace's 3.3 requests/s (it is the engine's cost
# this figure measures, not a queue that grows).
COST = {"c0": 0.002, "c_prefill": 1e-5, "c_decode": 2e-4}

_CHILD = """
import json, resource, sys, time
from app.replay.stepcost import StepCost
from app.replay.synth import synthesize
from app.replay.trace import open_trace
from app.replay.twin_replay import TwinConfig, predict
from engine.stream import SchedulerSettings
path, n, pool, cost = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
synthesize(n, path)
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
marks = {}
def progress(done):
    if done >= n // 4 and "quarter_rss" not in marks:
        marks["quarter_rss"], marks["quarter_at"] = rss(), done
t0 = time.perf_counter()
res = predict(open_trace(path), TwinConfig(StepCost(**cost), SchedulerSettings(pool_pages=pool)),
              progress=progress)
wall = time.perf_counter() - t0
print(json.dumps({"requests": res.requests, "steps": res.steps, "wall_s": wall,
                  "peak_rss": rss(), **marks}))
"""


def twin_scale_figures(quick: bool) -> tuple[dict, dict]:
    """(figures, details): the twin's requests/s and passes/s, its peak RSS and the RSS growth
    from a quarter of the trace to its end."""
    n = QUICK_REQUESTS if quick else REQUESTS
    with tempfile.TemporaryDirectory(prefix="prefixlab-bench-twin-scale-") as tmp:
        out = subprocess.run([sys.executable, "-c", _CHILD, os.path.join(tmp, "trace.jsonl"), str(n),
                              str(POOL_PAGES), json.dumps(COST)], env=child_env(), capture_output=True,
                             text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 1024 * 1024
    growth = (got["peak_rss"] - got["quarter_rss"]) / mib if "quarter_rss" in got else None
    note = f"{n:,} synthetic requests (seed 0), one replica, a pool of {POOL_PAGES:,} pages"
    figures = {
        "twin_requests_per_s": figure(got["requests"] / got["wall_s"], "requests/s", FEATURE, note=note),
        "twin_passes_per_s": figure(got["steps"] / got["wall_s"], "passes/s", FEATURE, note=note),
        "twin_peak_rss_mb": figure(got["peak_rss"] / mib, "MiB", FEATURE, note=note),
        "twin_rss_growth_mb": figure(growth, "MiB", FEATURE, note="peak RSS at the end minus at request "
                                     f"{got.get('quarter_at', n):,}"),
    }
    return figures, {"cost": COST, **got}
