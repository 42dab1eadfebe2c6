"""Bench section "KV events": block events per second the watcher keeps up with, headless.

A vLLM-shaped feed (app/watch/throughput.py) goes through decode + rebuild alone, and
through real ZeroMQ sockets on localhost (the sender shares the machine's cores).
"""

from __future__ import annotations

from app.watch.throughput import watch_throughput

from .common import figure

ISSUE = "KV events"
TARGET_EVENTS_PER_S = 50_000


def kv_events_figures(quick: bool) -> tuple[dict, dict]:
    d = watch_throughput(quick)
    figures = {
        "watch_block_events_per_s": figure(d["sockets"]["events_per_s"], "events/s", ISSUE,
                                           TARGET_EVENTS_PER_S, ">=", note="PUB -> watcher on localhost"),
        "watch_decode_apply_events_per_s": figure(d["decode_apply"]["events_per_s"], "events/s", ISSUE,
                                                  note="decode + rebuild, no sockets"),
    }
    return figures, d
