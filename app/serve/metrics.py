"""`GET /metrics`: the scheduler's counters and a TTFT histogram in Prometheus text format."""

from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PREFIX = "prefixlab"


class TtftHistogram:
    """Time to first token of served requests (fed by the server as each one finishes)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.counts = [0] * (len(TTFT_BUCKETS_S) + 1)
        self.total = 0.0
        self.finished: dict[str, int] = {}

    def observe(self, finish) -> None:
        """One finished served request (engine thread)."""
        r = finish.record
        with self._lock:
            self.finished[finish.reason] = self.finished.get(finish.reason, 0) + 1
            if r.ttft_s is not None:
                self.counts[bisect.bisect_left(TTFT_BUCKETS_S, r.ttft_s)] += 1
                self.total += r.ttft_s

    def lines(self) -> list[str]:
        """The histogram and the finish counts as Prometheus lines."""
        name = f"{PREFIX}_time_to_first_token_seconds"
        with self._lock:
            counts, total, finished = list(self.counts), self.total, dict(self.finished)
        out = [f"# HELP {name} Time from a served request's arrival to its first token.",
               f"# TYPE {name} histogram"]
        running = 0
        for bound, n in zip(TTFT_BUCKETS_S, counts):
            running += n
            out.append(f'{name}_bucket{{le="{bound:g}"}} {running}')
        running += counts[-1]
        out += [f'{name}_bucket{{le="+Inf"}} {running}', f"{name}_sum {total:.6f}", f"{name}_count {running}"]
        req = f"{PREFIX}_requests_finished_total"
        out += [f"# HELP {req} Served requests that finished, by reason.", f"# TYPE {req} counter"]
        out += [f'{req}{{finish_reason="{k}"}} {v}' for k, v in sorted(finished.items())]
        return out


# (metric, type, help, timeline column)
SCALARS = (
    ("prefix_cache_queries_total", "counter", "Prefix cache lookups (one per admitted request).", "queries"),
    ("prefix_cache_hits_total", "counter", "Lookups that matched at least one page.", "hits"),
    ("prefix_cache_hit_pages_total", "counter", "Pages attached from the prefix cache.", "hit_pages"),
    ("prefill_tokens_computed_total", "counter", "Prompt tokens the model computed.", "prefill_computed"),
    ("prefill_tokens_saved_total", "counter", "Prompt tokens attached from the cache instead.",
     "prefill_saved"),
    ("prefix_cache_chains", "gauge", "Cached chains.", "chains"),
    ("requests_running", "gauge", "Requests admitted to the batch.", "active"),
    ("requests_waiting", "gauge", "Requests waiting in the queue.", "queued"),
    ("pool_capacity_pages", "gauge", "KV pool pages.", "capacity"),
)
PAGE_STATES = (("free", "pages_free"), ("private", "pages_private"), ("shared", "pages_shared"),
               ("cached", "pages_cached"))


def render(row: dict, histogram: TtftHistogram, ready: bool) -> str:
    """Prometheus text for the latest timeline row (a dict; empty before the first step)."""
    out = [f"# HELP {PREFIX}_ready 1 once the model is loaded.", f"# TYPE {PREFIX}_ready gauge",
           f"{PREFIX}_ready {int(ready)}"]
    for name, kind, text, column in SCALARS:
        out += [f"# HELP {PREFIX}_{name} {text}", f"# TYPE {PREFIX}_{name} {kind}",
                f"{PREFIX}_{name} {int(row.get(column, 0))}"]
    pages = f"{PREFIX}_pool_pages"
    out += [f"# HELP {pages} KV pool pages by state (cached: held by the cache alone).",
            f"# TYPE {pages} gauge"]
    out += [f'{pages}{{state="{state}"}} {int(row.get(col, 0))}' for state, col in PAGE_STATES]
    out += histogram.lines()
    return "\n".join(out) + "\n"
