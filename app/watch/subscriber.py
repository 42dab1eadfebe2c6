"""Subscribe to one or many engines' KV-event feeds and keep each engine's cache rebuilt.

The watcher connects (the engines bind). Per endpoint it tracks the sequence
numbers: a jump forward is a gap, repaired from that engine's replay socket when
one is given (counted as a gap either way); a jump back is the engine restarting
(a new epoch: its cache starts empty), never a gap. Joining a feed late with a
replay socket first fetches what the publisher still buffers, so the rebuilt
cache includes blocks stored before the watcher started.

Nothing a peer sends can stop it: unreadable messages are counted and skipped,
and `ZMQ_MAXMSGSIZE` makes ZeroMQ refuse an oversized frame before it is
buffered (libzmq drops that connection; the watcher connects again: it shows as
a disconnect and a sequence gap, repaired by replay when there is one).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from app.kv_wire import BadFrame, decode_batch, parse_seq, seq_bytes, split_message

from .state import DEFAULT_MAX_BLOCKS, BatchResult, EngineState, cross_engine

DEFAULT_MAX_FRAME = 16 * 1024 * 1024
REPLAY_TIMEOUT_S = 1.0


class _Feed:
    """One endpoint: its sockets, the next sequence number expected and its engine's state."""

    def __init__(self, ctx: zmq.Context, state: EngineState, topic: bytes, replay: str | None,
                 max_frame: int):
        self.state, self.replay_endpoint, self.max_frame = state, replay, max_frame
        self.ctx = ctx
        self.dealer: zmq.Socket | None = None
        self.expected: int | None = None
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.MAXMSGSIZE, max_frame)
        self.sub.setsockopt(zmq.RCVHWM, 200_000)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        where = state.endpoint
        try:
            self.sub.connect(where)
            if replay:
                where = replay
                self.replay_socket()  # connect now: a bad address is an error at start, not mid-watch
        except zmq.ZMQError as e:
            self.close()  # an open socket would make the context's term() wait forever
            raise ValueError(f"cannot connect to {where}: {e}") from None

    def replay_socket(self) -> zmq.Socket:
        """The DEALER connected to this engine's replay endpoint (made on first use)."""
        if self.dealer is None:
            self.dealer = self.ctx.socket(zmq.DEALER)
            self.dealer.setsockopt(zmq.MAXMSGSIZE, self.max_frame)
            self.dealer.setsockopt(zmq.LINGER, 0)
            self.dealer.connect(self.replay_endpoint)
        return self.dealer

    def drop_replay_socket(self) -> None:
        """Forget a replay that timed out, so its late answers never mix with the next one."""
        if self.dealer is not None:
            self.dealer.close(linger=0)
            self.dealer = None

    def close(self) -> None:
        """Close this endpoint's sockets."""
        self.sub.disable_monitor()
        self.monitor.close(linger=0)
        self.sub.close(linger=0)
        self.drop_replay_socket()


class Watcher:
    """Many engines' KV-event feeds, each rebuilt into an `EngineState`; thread-safe snapshots."""

    def __init__(self, endpoints: list[str], replay_endpoints: list[str] | None = None, topic: str = "",
                 block_size: int | None = None, max_blocks: int = DEFAULT_MAX_BLOCKS,
                 max_frame: int = DEFAULT_MAX_FRAME, replay_timeout: float = REPLAY_TIMEOUT_S):
        if not endpoints:
            raise ValueError("watch needs at least one KV-event endpoint (e.g. tcp://127.0.0.1:5557)")
        replays = list(replay_endpoints or [])
        if len(replays) > len(endpoints):
            raise ValueError(f"{len(replays)} replay endpoints for {len(endpoints)} event endpoints: "
                             "give at most one replay endpoint per event endpoint, in the same order")
        self.ctx = zmq.Context()
        self.lock = threading.Lock()
        self.replay_timeout = replay_timeout
        self.feeds: list[_Feed] = []
        self.poller = zmq.Poller()
        try:
            for i, ep in enumerate(endpoints):
                state = EngineState(i, ep, max_blocks=max_blocks, block_size=block_size)
                state.topic = topic.encode("utf-8")
                feed = _Feed(self.ctx, state, state.topic, replays[i] if i < len(replays) else None,
                             max_frame)
                self.feeds.append(feed)
                self.poller.register(feed.sub, zmq.POLLIN)
                self.poller.register(feed.monitor, zmq.POLLIN)
        except ValueError:
            self.close()
            raise

    @property
    def states(self) -> list[EngineState]:
        """Each engine's state, in endpoint order."""
        return [f.state for f in self.feeds]

    # the loop ---------------------------------------------------------------
    def poll(self, timeout_ms: int = 100, max_messages: int = 10_000) -> list[BatchResult]:
        """Handle what arrives within `timeout_ms`; return one result per batch applied."""
        results: list[BatchResult] = []
        ready = dict(self.poller.poll(timeout_ms))
        while ready and len(results) < max_messages:
            for feed in self.feeds:
                if feed.monitor in ready:
                    self._drain_monitor(feed)
                if feed.sub in ready:
                    for _ in range(256):  # fair between engines: at most 256 messages each per round
                        try:
                            frames = feed.sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        results.extend(self.handle_message(feed.state.index, frames))
            ready = dict(self.poller.poll(0))
        return results

    def run(self, duration: float | None = None, on_batch: Callable[[BatchResult], None] | None = None,
            stop: threading.Event | None = None) -> None:
        """Watch until `duration` seconds pass or `stop` is set."""
        end = None if duration is None else time.monotonic() + duration
        while not (stop is not None and stop.is_set()):
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return
            for r in self.poll(int(100 if left is None else max(1, min(100, left * 1000)))):
                if on_batch is not None:
                    on_batch(r)

    def _drain_monitor(self, feed: _Feed) -> None:
        while True:
            try:
                msg = recv_monitor_message(feed.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg["event"] == zmq.EVENT_DISCONNECTED:
                with self.lock:
                    feed.state.counters.disconnects += 1
                # libzmq does not reconnect after a protocol error (an oversized frame is one):
                # connect again by hand; after a plain network error this only restarts the retry.
                try:
                    feed.sub.disconnect(feed.state.endpoint)
                except zmq.ZMQError:
                    pass
                feed.sub.connect(feed.state.endpoint)

    # sequence numbers -------------------------------------------------------
    def handle_message(self, engine: int, frames: list[bytes]) -> list[BatchResult]:
        """Apply one PUB message from engine `engine`; never raises on what the peer sent."""
        with self.lock:
            return self._on_message(self.feeds[engine], frames)

    def _on_message(self, feed: _Feed, frames: list[bytes]) -> list[BatchResult]:
        state = feed.state
        try:
            _, seq, payload = split_message(frames)
            if seq < 0:
                raise BadFrame(f"negative sequence number {seq} on the event socket")
            batch, bad = decode_batch(payload)
        except BadFrame:
            state.counters.bad_frames += 1
            return []
        out: list[BatchResult] = []
        if feed.expected is None:
            if seq > 0 and feed.replay_endpoint:
                out = self._replay(feed, 0, seq, catch_up=True)
            if seq > 0 and state.counters.batches == 0:
                state.joined_at_seq = seq
        elif seq < feed.expected:
            # PUB delivers in order, so going back means the publisher started again.
            state.new_epoch()
            if seq > 0 and feed.replay_endpoint:
                out = self._replay(feed, 0, seq, catch_up=True)
        elif seq > feed.expected:
            state.counters.seq_gaps += 1
            state.counters.missed_batches += seq - feed.expected
            if feed.replay_endpoint:
                out = self._replay(feed, feed.expected, seq)
        out.append(state.apply(seq, batch, bad))
        feed.expected = seq + 1
        return out

    def _replay(self, feed: _Feed, start: int, stop: int, catch_up: bool = False) -> list[BatchResult]:
        """Fetch batches [start, stop) from the feed's replay socket and apply them in order."""
        sock = feed.replay_socket()
        sock.send_multipart([b"", seq_bytes(start)])
        got: list[BatchResult] = []
        deadline = time.monotonic() + self.replay_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                feed.drop_replay_socket()
                break
            frames = sock.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]  # the ROUTER's delimiter (REQ-style envelope)
            try:
                if len(frames) != 2:
                    raise BadFrame(f"replay answer has {len(frames)} frames, expected 2")
                seq = parse_seq(frames[0])
                if seq == -1:
                    break
                if not (start <= seq < stop) or (got and seq <= got[-1].seq):
                    continue
                batch, bad = decode_batch(frames[1])
            except BadFrame:
                feed.state.counters.bad_frames += 1
                continue
            if catch_up and not got and seq > 0:
                feed.state.joined_at_seq = seq  # the publisher's buffer no longer starts at 0
            got.append(feed.state.apply(seq, batch, bad, replayed=True))
        if not catch_up:
            feed.state.counters.repaired_batches += len(got)
        return got

    # reading ----------------------------------------------------------------
    def snapshot(self, with_blocks: bool = False) -> dict:
        """Every engine's state and the cross-engine duplication, as plain data (takes the lock)."""
        with self.lock:
            return {"engines": [s.to_json(with_blocks) for s in self.states],
                    "cross_engine": cross_engine(self.states)}

    def close(self) -> None:
        """Close every socket and the ZeroMQ context."""
        for feed in self.feeds:
            feed.close()
        self.ctx.term()
