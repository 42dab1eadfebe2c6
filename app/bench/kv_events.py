"""Bench section "KV events": the watcher headless and in the app, on a vLLM-shaped feed.

Headless: the feed (app/watch/throughput.py) goes through real ZeroMQ sockets on localhost
(the sender shares the machine's cores) and through decode + rebuild alone. In the app: the
"Watch a server" window in a child process, fed at 5,000 block events/s, and the longest
gap between ticks of a 10 ms timer on its UI thread (app/watch/ui_stall.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

from app.watch.throughput import watch_throughput

from .common import child_env, figure, target

FEATURE = "KV events"  # the table's and the JSON's "feature" of its figures
UI_RATE = 5_000


def ui_stall(quick: bool) -> dict:
    """The watch window's longest UI stall at UI_RATE events/s, from a child process."""
    cmd = [sys.executable, "-m", "app.watch.ui_stall", "--rate", str(UI_RATE),
           "--seconds", "2" if quick else "5"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         env=child_env(QT_QPA_PLATFORM="offscreen"))
    if out.returncode != 0:
        raise RuntimeError(f"ui_stall child failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def kv_events_figures(quick: bool) -> tuple[dict, dict]:
    """The section's figures and the raw measurements."""
    d = watch_throughput(quick)
    d["ui"] = ui = ui_stall(quick)
    figures = {
        "watch_block_events_per_s": figure(d["sockets"]["events_per_s"], "events/s", FEATURE,
                                           **target("watch_block_events_per_s"),
                                           note="PUB -> watcher on localhost"),
        "watch_decode_apply_events_per_s": figure(d["decode_apply"]["events_per_s"], "events/s", FEATURE,
                                                  note="decode + rebuild, no sockets"),
        "watch_ui_stall_ms": figure(ui["max_stall_ms"], "ms", FEATURE, **target("watch_ui_stall_ms"),
                                    note=f"watch window at {UI_RATE:,} block events/s; idle "
                                         f"baseline {ui['idle_max_stall_ms']:.0f} ms"),
    }
    return figures, d
