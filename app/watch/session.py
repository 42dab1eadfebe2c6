"""A watcher on its own thread, for the app: the UI reads the latest snapshot and never waits.

The thread polls the feeds and, every `snapshot_every` seconds, builds a plain
`WatchSnapshot` (counters, chart history, chains, cross-engine duplication)
and swaps it in; the UI thread only reads `latest`, an attribute assignment
away, so a feed of any rate cannot stall it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from .router_score import router_scores
from .state import cross_engine
from .subscriber import Watcher


@dataclass
class EngineView:
    """One engine as the UI draws it."""

    summary: dict                      # counters, endpoint, DP rank (EngineState.summary())
    history: list                      # (ts, stored_blocks, removed_blocks, live_blocks) per batch
    chains: list                       # EngineState.chains(): one tree per root
    cells: list                        # EngineState.block_cells(): the block map's chain ranks


@dataclass
class WatchSnapshot:
    """Every engine and the cross-engine view at one moment."""

    taken_at: float
    engines: list[EngineView] = field(default_factory=list)
    cross_engine: dict = field(default_factory=dict)
    router: dict | None = None         # router_scores() for the prompt set with set_prompt, if any


class WatchSession:
    """Runs a `Watcher` on a daemon thread; `latest` is the newest snapshot (None before the first)."""

    def __init__(self, endpoints: list[str], replay_endpoints: list[str] | None = None, topic: str = "",
                 snapshot_every: float = 0.25, **watcher_args):
        self.watcher = Watcher(endpoints, replay_endpoints, topic=topic, **watcher_args)
        self.snapshot_every = snapshot_every
        self.latest: WatchSnapshot | None = None
        self.error: str | None = None
        self.prompt: list[int] | None = None  # token ids a precise router would place (set_prompt)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-watch", daemon=True)

    def start(self) -> WatchSession:
        """Start the watcher thread; return self."""
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.watcher.run(self.snapshot_every, stop=self._stop)
                self.latest = self.take_snapshot()
        except Exception as e:  # noqa: BLE001 - shown in the UI; the app keeps running
            self.error = f"{type(e).__name__}: {e}"

    def take_snapshot(self) -> WatchSnapshot:
        """Build a snapshot now (under the watcher's lock)."""
        with self.watcher.lock:
            states = self.watcher.states
            views = [EngineView(s.summary(), list(s.history), s.chains(), s.block_cells()) for s in states]
            prompt = self.prompt
            router = router_scores(states, prompt) if prompt else None
            return WatchSnapshot(time.time(), views, cross_engine(states), router)

    def set_prompt(self, tokens: list[int] | None) -> None:
        """Score this prompt on every engine in the next snapshots (None: stop)."""
        self.prompt = list(tokens) if tokens else None

    def stop(self) -> None:
        """Stop the thread and close the sockets."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self.watcher.close()
