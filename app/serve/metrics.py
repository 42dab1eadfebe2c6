"""`GET /metrics`: the scheduler's counters and a TTFT histogram in Prometheus text format."""

from __future__ import annotations

import bisect
import threading

from engine.token_parts import PARTS, TokenParts

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PREFIX = "prefixlab"


class TtftHistogram:
    """Time to first token of served requests, their finish reasons and where their prompt
    tokens went (fed by the server as each one finishes). `isolated` counts as `new` unless
    `show_isolated` (`--metrics-isolated`): a scrape must not tell one tenant of another's traffic."""

    def __init__(self, show_isolated: bool = False):
        self._lock = threading.Lock()
        self.counts = [0] * (len(TTFT_BUCKETS_S) + 1)
        self.total = 0.0
        self.finished: dict[str, int] = {}
        self.show_isolated = show_isolated
        self.parts = dict.fromkeys((*PARTS, "disk"), 0)

    def observe(self, finish) -> None:
        """One finished served request (engine thread)."""
        r = finish.record
        with self._lock:
            self.finished[finish.reason] = self.finished.get(finish.reason, 0) + 1
            if r.ttft_s is not None:
                self.counts[bisect.bisect_left(TTFT_BUCKETS_S, r.ttft_s)] += 1
                self.total += r.ttft_s
            parts = r.parts or TokenParts(new=r.n_prompt)
            for k in self.parts:
                self.parts[k] += getattr(parts, k)

    def lines(self) -> list[str]:
        """The histogram and the finish counts as Prometheus lines."""
        name = f"{PREFIX}_time_to_first_token_seconds"
        with self._lock:
            counts, total, finished = list(self.counts), self.total, dict(self.finished)
            parts = dict(self.parts)
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
        return out + self._parts_lines(parts)

    def _parts_lines(self, parts: dict[str, int]) -> list[str]:
        """Served prompt tokens by part (docs/design.md §15), and those loaded from the disk tier."""
        if not self.show_isolated:
            parts["new"] += parts.pop("isolated")
        name, disk = f"{PREFIX}_prompt_tokens_total", f"{PREFIX}_prompt_tokens_from_disk_total"
        out = [f"# HELP {name} Served prompt tokens by where they went (they add up to the prompts).",
               f"# TYPE {name} counter"]
        out += [f'{name}{{part="{p}"}} {parts[p]}' for p in PARTS if p in parts]
        return out + [f"# HELP {disk} Of the cached prompt tokens, those loaded back from the disk tier.",
                      f"# TYPE {disk} counter", f"{disk} {parts['disk']}"]


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
