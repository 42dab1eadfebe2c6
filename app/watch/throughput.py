"""How many block events per second the watcher keeps up with (the bench's "KV events" figures).

The feed is vLLM-shaped: per batch, 32 `BlockStored` of 4 blocks (16 tokens
each) and one `BlockRemoved` of the 128 oldest blocks, so the cache stays at a
steady size, as in a full engine. A block event is one block stored or removed.
"""

from __future__ import annotations

import threading
import time

import zmq

from app.kv_wire import encode_batch, removed_event, seq_bytes, stored_event

from .subscriber import Watcher

STORES_PER_BATCH, BLOCKS_PER_STORE, BLOCK_SIZE = 32, 4, 16
BLOCK_EVENTS_PER_BATCH = 2 * STORES_PER_BATCH * BLOCKS_PER_STORE


def vllm_like_batches(n_batches: int) -> list[bytes]:
    """Encoded batches: each stores 128 new blocks in 32 chains and removes the 128 oldest."""
    out, next_hash, live = [], 1, []
    for i in range(n_batches):
        events = []
        for _ in range(STORES_PER_BATCH):
            hashes = list(range(next_hash, next_hash + BLOCKS_PER_STORE))
            next_hash += BLOCKS_PER_STORE
            events.append(stored_event(hashes, None, list(range(BLOCK_SIZE * BLOCKS_PER_STORE)), BLOCK_SIZE,
                                       medium="GPU"))
            live.extend(hashes)
        per_batch = STORES_PER_BATCH * BLOCKS_PER_STORE
        if len(live) > 4 * per_batch:
            gone, live = live[:per_batch], live[per_batch:]
            events.append(removed_event(gone, medium="GPU"))
        out.append(encode_batch(events, ts=float(i)))
    return out


def _block_events(watcher: Watcher) -> int:
    c = watcher.states[0].counters
    return c.stored_blocks + c.removed_blocks


def decode_apply_rate(payloads: list[bytes]) -> dict:
    """Block events per second through decode + apply alone (no sockets)."""
    watcher = Watcher(["tcp://127.0.0.1:9"])  # connect() is lazy: nothing listens, nothing arrives
    try:
        t0 = time.perf_counter()
        for seq, payload in enumerate(payloads):
            watcher.handle_message(0, [b"", seq_bytes(seq), payload])
        dt = time.perf_counter() - t0
        return {"block_events": _block_events(watcher), "seconds": dt,
                "events_per_s": _block_events(watcher) / dt}
    finally:
        watcher.close()


def socket_rate(payloads: list[bytes], timeout: float = 60.0) -> dict:
    """Block events per second from a PUB socket sending as fast as it can to a watcher on localhost."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, len(payloads) + 10)
    pub.bind("tcp://127.0.0.1:*")
    watcher = Watcher([pub.getsockopt_string(zmq.LAST_ENDPOINT)])
    try:
        if not pub.poll(10_000):
            raise RuntimeError("the watcher never subscribed")
        pub.recv()

        def send():
            for seq, payload in enumerate(payloads):
                pub.send_multipart([b"", seq_bytes(seq), payload])
        sender = threading.Thread(target=send, daemon=True)
        t0 = time.perf_counter()
        sender.start()
        state = watcher.states[0]
        end = time.monotonic() + timeout
        while state.counters.batches < len(payloads) and time.monotonic() < end:
            watcher.poll(50)
        dt = time.perf_counter() - t0
        sender.join()
        n = _block_events(watcher)
        return {"block_events": n, "seconds": dt, "events_per_s": n / dt,
                "batches": state.counters.batches, "seq_gaps": state.counters.seq_gaps}
    finally:
        watcher.close()
        pub.close(0)
        ctx.term()


def watch_throughput(quick: bool = False) -> dict:
    """Both rates over the same feed (quick: a second's worth, for tests)."""
    payloads = vllm_like_batches(40 if quick else 800)
    return {"feed": {"batches": len(payloads), "block_events_per_batch": BLOCK_EVENTS_PER_BATCH,
                     "block_size": BLOCK_SIZE},
            "decode_apply": decode_apply_rate(payloads), "sockets": socket_rate(payloads)}
