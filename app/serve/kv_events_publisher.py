"""Publish PrefixLab's own prefix cache as vLLM KV events (ZeroMQ PUB + a replay ROUTER).

The publisher is a cache listener (`cache.add_listener(publisher)`). The engine
thread only appends the event to a bounded queue; a sender thread turns queued
events into one `KVEventBatch` per wake-up, sends it, and keeps the last
`buffer_steps` batches for the replay socket. A queue past `max_queue` drops
events and counts them (`dropped_events`): the engine never waits on a slow
network.

Key translation: PrefixLab's page keys are 64-bit unsigned ints (blake2b of the
parent key and the page's tokens, the namespace salting the first page), so
they go on the wire as msgpack ints, like vLLM's int hashes; equal keys on two
PrefixLab servers mean equal prefixes. Each insert call's new pages go as one
`BlockStored` (a parent-linked run, as vLLM batches a request's blocks), each
eviction batch as one `BlockRemoved`, `prefix_release` as `AllBlocksCleared`.
The medium names the tier, as vLLM's does: "GPU" for the pool's pages (PrefixLab's fast
tier, though it lives in host memory) and "CPU" for the disk tier under it.

Sockets bind (the watchers connect). ZeroMQ has no authentication: bind to
127.0.0.1 unless every host that can reach the port may read the cache.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import zmq

from ..kv_wire import (
    END_SEQ,
    cleared_event,
    encode_batch,
    normalize_endpoint,
    removed_event,
    seq_bytes,
    stored_event,
)

MAX_EVENTS_PER_BATCH = 4096


def _wire_events(kind: str, pages, medium: str = "GPU") -> list:
    """The wire events for one cache event: stored pages split into parent-linked runs."""
    if kind == "cleared":
        return [cleared_event()]
    if kind == "removed":
        return [removed_event([p.key for p in pages], medium)] if pages else []
    out, run = [], []
    for p in pages:
        if run and p.parent != run[-1].key:
            out.append(_stored(run, medium))
            run = []
        run.append(p)
    if run:
        out.append(_stored(run, medium))
    return out


def _stored(run, medium: str) -> list:
    tokens = [t for p in run for t in p.tokens]
    return stored_event([p.key for p in run], run[0].parent, tokens, len(run[0].tokens), medium)


class KVEventPublisher:
    """A cache listener that publishes every store, eviction and flush on a ZeroMQ PUB socket."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:5557", replay_endpoint: str | None = None,
                 topic: str = "", buffer_steps: int = 10_000, max_queue: int = 100_000,
                 data_parallel_rank: int = 0, hwm: int = 100_000):
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.topic = topic.encode("utf-8")
        self.rank = data_parallel_rank
        self.max_queue = max_queue
        self.published_batches = self.published_events = self.dropped_events = 0
        self.queued_total = self.sent_total = 0   # cache events taken in / handed to ZeroMQ
        self.replay_requests = self.subscriptions = 0
        self._queue: deque = deque()
        self._cache = None
        self._buffer: deque = deque(maxlen=buffer_steps)
        self._seq = 0
        self._wake = threading.Event()
        self._stopping = False
        self._ctx = zmq.Context()
        # XPUB is PUB on the wire; it also tells us when a watcher subscribes.
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._replay: zmq.Socket | None = None
        where = endpoint
        try:
            self._pub.bind(endpoint)
            if replay_endpoint:
                where = replay_endpoint
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"cannot bind KV events to {where}: {e}") from None
        # A port "*" binds a free port: report the one bound.
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        if self._replay is not None:
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    # the engine thread's side ----------------------------------------------
    def __call__(self, event) -> None:
        """The cache listener: queue the event (never blocks; drops and counts past `max_queue`)."""
        self._enqueue(event.kind, tuple(event.pages), event.medium)

    def _enqueue(self, kind: str, pages: tuple, medium: str = "GPU") -> None:
        if len(self._queue) >= self.max_queue:
            self.dropped_events += 1
            return
        self._queue.append((kind, pages, medium))
        self.queued_total += 1
        self._wake.set()

    def attach(self, cache) -> KVEventPublisher:
        """Listen to a prefix cache's changes; return self.

        Attaching to a new cache (a server that rebuilt its scheduler) first publishes
        `AllBlocksCleared`: the watchers drop the old cache's blocks.
        """
        if self._cache is not None and self._cache is not cache:
            self._cache.remove_listener(self)
            self._enqueue("cleared", ())
        self._cache = cache
        cache.add_listener(self)
        return self

    def detach(self) -> None:
        """Stop listening to the cache."""
        if self._cache is not None:
            self._cache.remove_listener(self)
            self._cache = None

    # the sender thread ------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.wait(0.02)
            self._wake.clear()
            while self._pub.poll(0):
                if self._pub.recv()[:1] == b"\x01":
                    self.subscriptions += 1
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            while self._queue:
                self._send_batch()
            if self._stopping and not self._queue:
                return

    def _send_batch(self) -> None:
        events: list = []
        n = 0
        while self._queue and n < MAX_EVENTS_PER_BATCH:
            kind, pages, medium = self._queue.popleft()
            events.extend(_wire_events(kind, pages, medium))
            n += 1
        if not events:
            self.sent_total += n
            return
        payload = encode_batch(events, data_parallel_rank=self.rank)
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart([self.topic, seq_bytes(seq), payload])
        self._buffer.append((seq, payload))
        self.published_batches += 1
        self.published_events += len(events)
        self.sent_total += n

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        # REQ and DEALER-with-delimiter clients send [id, b"", seq]; a bare DEALER [id, seq].
        if len(frames) == 3 and frames[1] == b"" and len(frames[2]) == 8:
            envelope = frames[:2]
        elif len(frames) == 2 and len(frames[1]) == 8:
            envelope = frames[:1]
        else:
            return
        self.replay_requests += 1
        start = int.from_bytes(frames[-1], "big", signed=True)
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart([*envelope, seq_bytes(seq), payload])
        self._replay.send_multipart([*envelope, END_SEQ, b""])

    # shutdown ---------------------------------------------------------------
    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, then close the sockets."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=500)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued cache event is on the wire; False on timeout."""
        end = time.monotonic() + timeout
        self._wake.set()
        while self.sent_total < self.queued_total and time.monotonic() < end:
            time.sleep(0.005)
        return self.sent_total >= self.queued_total

    def wait_for_subscriber(self, timeout: float = 5.0) -> bool:
        """Wait until a watcher has subscribed (what it misses before that, only replay gives back)."""
        end = time.monotonic() + timeout
        while self.subscriptions == 0 and time.monotonic() < end:
            time.sleep(0.01)
        return self.subscriptions > 0

    def stats(self) -> dict:
        """Counters for /metrics and the app."""
        return {"published_batches": self.published_batches, "published_events": self.published_events,
                "dropped_events": self.dropped_events, "replay_requests": self.replay_requests,
                "subscriptions": self.subscriptions,
                "queued_events": len(self._queue)}


# command line ---------------------------------------------------------------
def add_kv_events_args(p) -> None:
    """`--kv-events`, `--kv-events-replay`, `--kv-events-topic` on a command that runs a scheduler."""
    g = p.add_argument_group("KV events (vLLM's wire format; ZeroMQ has no authentication)")
    g.add_argument("--kv-events", metavar="ENDPOINT",
                   help="publish every cache store, eviction and flush here (e.g. tcp://127.0.0.1:5557; "
                        "a bare port binds 127.0.0.1)")
    g.add_argument("--kv-events-replay", metavar="ENDPOINT",
                   help="serve missed batches to watchers here (e.g. tcp://127.0.0.1:5567)")
    g.add_argument("--kv-events-topic", default="", metavar="TOPIC",
                   help="topic of every message (default: none)")


def publisher_from_args(args) -> KVEventPublisher | None:
    """The publisher the options ask for (bound now, so a taken port fails at start), or None."""
    events, replay = getattr(args, "kv_events", None), getattr(args, "kv_events_replay", None)
    if not events:
        if replay:
            raise ValueError("--kv-events-replay needs --kv-events")
        return None
    return KVEventPublisher(normalize_endpoint(events), normalize_endpoint(replay) if replay else None,
                            topic=args.kv_events_topic)
