"""KV events in vLLM's wire format: the codec against vLLM's own struct layout, real ZeroMQ feeds."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.kv_wire import (
    END_SEQ,
    AllBlocksCleared,
    BadFrame,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
    removed_event,
    stored_event,
)
from app.watch.subscriber import Watcher
from tests.wait import wait_until


# vLLM's declarations (vllm/distributed/kv_events.py, array_like era, newest fields), rebuilt
# here so the test encodes exactly what a vLLM engine puts on the wire.
class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
    pass


def _h(i: int) -> bytes:
    return i.to_bytes(32, "big")  # vLLM's sha256 block hashes are 32 bytes


def test_our_encoding_decodes_with_vllms_own_structs():
    payload = encode_batch([stored_event([1, 2], None, [5, 6, 7, 8], 2), removed_event([2]),
                            ["AllBlocksCleared"]], ts=12.5, data_parallel_rank=3)
    vbatch = msgspec.msgpack.Decoder(VEventBatch).decode(payload)
    assert (vbatch.ts, vbatch.data_parallel_rank) == (12.5, 3)
    events = msgspec.convert(vbatch.events, list[VBlockStored | VBlockRemoved | VAllBlocksCleared])
    assert events[0] == VBlockStored([1, 2], None, [5, 6, 7, 8], 2, None, "CPU", None)
    assert events[1] == VBlockRemoved([2], "CPU") and isinstance(events[2], VAllBlocksCleared)


def test_decoder_reads_trailing_unknown_fields_omitted_defaults_bytes_and_maps():
    raw = [1.0, [["BlockStored", [_h(1)], None, [1, 2], 2, None, "GPU", None, [None], 0, "full", None,
                  "a field from a future vLLM"],
                 ["BlockStored", [7], 9, [3, 4], 2],                 # before `medium` existed
                 {"type": "BlockRemoved", "block_hashes": [7], "medium": None, "session_id": "x"},
                 ["SomethingNew", 1, 2]], 0, "trailing batch field"]
    batch, bad = decode_batch(msgspec.msgpack.encode(raw))
    assert bad == 1  # the unknown event is skipped, the rest kept
    assert batch.events[0] == BlockStored([_h(1)], None, [1, 2], 2, None, "GPU", None, [None], 0)
    assert batch.events[1] == BlockStored([7], 9, [3, 4], 2)
    assert batch.events[2] == BlockRemoved([7]) and batch.data_parallel_rank == 0
    cleared, _ = decode_batch(msgspec.msgpack.encode({"ts": 2.0, "events": [{"type": "AllBlocksCleared"}]}))
    assert cleared.events == [AllBlocksCleared()]


@pytest.mark.parametrize("payload", [b"", b"\xc1", msgspec.msgpack.encode([1.0]),
                                     msgspec.msgpack.encode({"ts": "x", "events": []}),
                                     msgspec.msgpack.encode([1.0, "not a list"])])
def test_garbage_is_a_bad_frame_with_a_reason(payload):
    with pytest.raises(BadFrame, match="msgpack|batch"):
        decode_batch(payload)


_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=40) | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(
        st.sampled_from(["type", "block_hashes", "token_ids", "ts", "events", "medium"]), inner, max_size=4),
    max_leaves=30)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.lists(st.binary(max_size=64), max_size=4),
       value=st.tuples(st.floats(), st.lists(_msgpack_values, max_size=4), _msgpack_values))
def test_fuzz_any_frames_are_counted_never_raised(frames, value, unused_endpoint):
    watcher = _fuzz_watcher(unused_endpoint)
    state = watcher.states[0]
    before = state.counters.bad_frames + state.counters.batches
    watcher.handle_message(0, frames)
    watcher.handle_message(0, [b"", (5).to_bytes(8, "big"), msgspec.msgpack.encode(list(value))])
    # every message is either applied as a batch or counted as bad: nothing raises, nothing is lost
    assert state.counters.bad_frames + state.counters.batches == before + 2
    assert state.live == sum(len(b) for b in state.tiers.values())


_FUZZ: dict = {}


def _fuzz_watcher(endpoint):
    if endpoint not in _FUZZ:  # one watcher for all examples: sockets are slow to make
        _FUZZ[endpoint] = Watcher([endpoint], max_blocks=1000)
    return _FUZZ[endpoint]


@pytest.fixture(scope="module")
def unused_endpoint():
    yield "tcp://127.0.0.1:9"  # connect() is lazy: nothing needs to listen there
    for w in _FUZZ.values():
        w.close()
    _FUZZ.clear()


class FakeVLLM:
    """vLLM's publisher protocol on real sockets: XPUB (PUB on the wire) plus a replay ROUTER."""

    def __init__(self, topic: bytes = b"kv"):
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic, self.buffer, self.seq = topic, [], 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def wait_subscribed(self):
        assert self.pub.poll(5000), "the watcher never subscribed"
        self.pub.recv()

    def publish(self, events, drop: bool = False):
        payload = msgspec.msgpack.encode(VEventBatch(time.time(), events, 0))
        self.buffer.append((self.seq, payload))
        if not drop:  # a dropped batch is still in the replay buffer, as when a network hiccups
            self.pub.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def _serve(self):
        while not self.stop.is_set():
            if self.router.poll(20):
                client, _, start = self.router.recv_multipart()
                for seq, buf in list(self.buffer):
                    if seq >= int.from_bytes(start, "big"):
                        self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), buf])
                self.router.send_multipart([client, b"", END_SEQ, b""])

    def close(self):
        self.stop.set()
        self.thread.join()
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


def _watch_until(watcher, done, timeout=10.0):
    wait_until(done, timeout, lambda: f"the watcher to catch up: {watcher.snapshot()}",
               step=lambda: watcher.poll(50))


def test_vllm_layout_feed_rebuilt_with_a_gap_repaired_from_replay():
    vllm = FakeVLLM()
    watcher = Watcher([vllm.endpoint], [vllm.replay_endpoint], topic="kv")
    try:
        vllm.wait_subscribed()
        stored = lambda hashes, parent, toks: VBlockStored(hashes, parent, toks, 2, None, "GPU", None,  # noqa: E731
                                                           [None] * len(hashes), 0, "full_attention")
        vllm.publish([stored([_h(1), _h(2)], None, [1, 2, 3, 4])])
        vllm.publish([stored([_h(3)], _h(2), [5, 6])], drop=True)           # the gap
        vllm.publish([stored([_h(1)], None, [1, 2]),                          # stored twice
                      VBlockRemoved([_h(2)], "GPU", 0), stored([_h(4)], _h(3), [7, 8])])
        state = watcher.states[0]
        _watch_until(watcher, lambda: state.counters.batches == 3)
        c = state.counters
        assert (c.seq_gaps, c.missed_batches, c.repaired_batches) == (1, 1, 1)
        assert state.block_hashes() == {_h(1), _h(3), _h(4)}
        blocks = state.tiers[("GPU", 0)]
        assert blocks[_h(3)].parent == _h(2) and blocks[_h(4)].parent == _h(3)
        assert blocks[_h(4)].tokens == (7, 8)
        assert (c.stored_blocks, c.duplicate_stores, c.removed_blocks) == (4, 1, 1)
        vllm.publish([VAllBlocksCleared()])
        _watch_until(watcher, lambda: c.cleared == 1)
        assert state.live == 0
    finally:
        watcher.close()
        vllm.close()


def test_restart_is_a_new_epoch_and_late_join_catches_up_from_replay():
    vllm = FakeVLLM(topic=b"")
    stored = lambda h, p: VBlockStored([h], p, [h, h], 2, None, "GPU", None)  # noqa: E731
    vllm.publish([stored(1, None)], drop=True)   # before any watcher: only replay has it
    watcher = Watcher([vllm.endpoint], [vllm.replay_endpoint])
    try:
        vllm.wait_subscribed()
        vllm.publish([stored(2, 1)])
        state = watcher.states[0]
        _watch_until(watcher, lambda: state.counters.batches == 2)
        assert state.block_hashes() == {1, 2} and state.counters.seq_gaps == 0
        vllm.seq, vllm.buffer = 0, []            # the engine restarts: seq back to 0
        vllm.publish([stored(5, None)])
        _watch_until(watcher, lambda: state.counters.epochs == 2)
        assert state.block_hashes() == {5} and state.counters.seq_gaps == 0
    finally:
        watcher.close()
        vllm.close()


def test_oversized_frame_is_refused_and_the_watcher_keeps_going():
    vllm = FakeVLLM(topic=b"")
    watcher = Watcher([vllm.endpoint], [vllm.replay_endpoint], max_frame=64 * 1024)
    try:
        vllm.wait_subscribed()
        state = watcher.states[0]
        vllm.pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\x00" * (1024 * 1024)])
        vllm.seq = 1
        def publish_and_poll() -> None:
            vllm.publish([VBlockStored([vllm.seq], None, [1], 1, None, "GPU", None)])
            watcher.poll(100)

        wait_until(lambda: state.counters.batches > 0, 10, "a batch after the reconnect",
                   step=publish_and_poll)
        assert state.counters.disconnects >= 1
        assert state.live == state.counters.batches  # one block per batch, none lost once back
    finally:
        watcher.close()
        vllm.close()
