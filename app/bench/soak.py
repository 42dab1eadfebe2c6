"""Bench section "soak": 1,000 distinct chats, one after another, against `prefixlab serve` as shipped.

The server runs with its default settings (so with its default KV budget, a share of RAM).
Its resident memory is sampled as the requests go: the peak may exceed the memory it had
after the first few requests (model, code, workspaces: the fixed overhead) by the budget it states in
/health and no more; and the last 100 requests answer as fast as the first 100 (request
records, labels and cache lookups must not pile up). --quick: 60 requests, windows of 20.
"""

from __future__ import annotations

import random
import statistics
import time

import httpx

from ..serve import loadtest
from .common import child_env, figure, ratio
from .serve import free_port

FEATURE = "soak"  # the table's and the JSON's "feature" of its figures
REQUESTS, WINDOW = 1000, 100
QUICK_REQUESTS, QUICK_WINDOW = 60, 20
MAX_TOKENS = 4
SLACK_MB = 64          # allocator and page-rounding noise on top of budget + overhead
WARM_UP = 5            # requests before the fixed overhead is read (first-use workspaces, pool start)
TARGET_SPEED_RATIO = 1.25
WORDS = ("harbor lantern cedar quartz meadow falcon copper violet summit ember tundra orchid granite "
         "willow saffron beacon glacier juniper marble nectar").split()


def rss_mb(pid: int) -> float:
    """Resident memory of a process (Linux /proc), in MB."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError(f"no VmRSS for process {pid}")


def distinct_chat(i: int, rng: random.Random) -> list[dict]:
    """A chat no earlier one shares a page with: it starts with its own number and words."""
    words = " ".join(rng.choice(WORDS) for _ in range(40))
    return [{"role": "system", "content": f"Session {i}. {words}. Answer briefly."},
            {"role": "user", "content": f"Question {i}: which of these words comes first?"}]


def soak_figures(model_path: str, quick: bool) -> tuple[dict, dict]:
    """The section: one `prefixlab serve` child, `REQUESTS` chats, RSS and latency windows."""
    n, window = (QUICK_REQUESTS, QUICK_WINDOW) if quick else (REQUESTS, WINDOW)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = loadtest.start_server([loadtest.python(), "-m", "app.cli", "serve", "--model", model_path,
                                  "--port", str(port)], base + "/v1", env=child_env(), ready_path="/health")
    rng = random.Random(21)
    latencies, samples = [], []
    try:
        health = httpx.get(base + "/health", timeout=10).json()
        budget_mb = health.get("kv_budget_bytes", 0) / 1e6
        with httpx.Client(base_url=base, timeout=120) as client:
            for i in range(n):
                body = {"messages": distinct_chat(i, rng), "max_tokens": MAX_TOKENS, "temperature": 0,
                        "ignore_eos": True}
                t0 = time.perf_counter()
                r = client.post("/v1/chat/completions", json=body)
                latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    raise RuntimeError(f"request {i} failed: {r.status_code} {r.text[:200]}")
                if i + 1 == WARM_UP or (i + 1) % max(1, n // 20) == 0:
                    samples.append((i + 1, rss_mb(proc.pid)))
    finally:
        loadtest.stop_server(proc)
    overhead_mb = next(mb for done, mb in samples if done == WARM_UP)
    peak_mb = max(mb for _, mb in samples)
    bound_mb = overhead_mb + budget_mb + SLACK_MB
    first, last = statistics.median(latencies[:window]), statistics.median(latencies[-window:])
    figures = {
        "soak_rss_peak_mb": figure(peak_mb, "MB", FEATURE, bound_mb, "<=",
                                   note=f"{n} distinct chats; bound: {overhead_mb:.0f} MB after {WARM_UP} "
                                        f"requests + the {budget_mb:.0f} MB KV budget + {SLACK_MB} MB"),
        "soak_kv_budget_mb": figure(budget_mb, "MB", FEATURE, note="serve's default budget (/health)"),
        "soak_last_vs_first_latency": figure(ratio(last, first), "ratio", FEATURE, TARGET_SPEED_RATIO, "<=",
                                             note=f"median latency of the last {window} requests / the "
                                                  f"first {window}"),
    }
    details = {"requests": n, "window": window, "max_tokens": MAX_TOKENS, "rss_samples_mb": samples,
               "overhead_mb": overhead_mb, "first_median_s": first, "last_median_s": last,
               "health": health}
    return figures, details
