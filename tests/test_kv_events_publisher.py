"""The KV-event publisher: vLLM's replay protocol for REQ and DEALER clients, bind errors, no blocking."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from app.kv_wire import BlockStored, decode_batch, parse_seq
from app.serve.kv_events_publisher import KVEventPublisher
from tests.kv_events_helpers import Event, Page
from tests.wait import wait_until


def _replay_with(kind: int, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    sock.connect(endpoint)
    try:
        if kind == zmq.REQ:  # vLLM's example subscriber: the REQ adds the empty delimiter itself
            sock.send(start.to_bytes(8, "big"))
        else:
            sock.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert sock.poll(5000), "no replay answer"
            frames = sock.recv_multipart()
            seq_frame, payload = frames[-2], frames[-1]
            if parse_seq(seq_frame) == -1:
                return got
            got.append((parse_seq(seq_frame), payload))
            if kind == zmq.REQ:
                return got  # a REQ socket takes one answer per request
    finally:
        sock.close(0)
        ctx.term()


def test_replay_serves_buffered_batches_to_dealer_and_req_clients():
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=2)
    try:
        for i in range(3):
            pub(Event("stored", (Page(10 + i, None, (i, i)),)))
            wait_until(lambda i=i: pub.published_batches > i, 5, "the batch to be published", interval=0.005)
        got = _replay_with(zmq.DEALER, pub.replay_endpoint, 0)
        assert [seq for seq, _ in got] == [1, 2]  # the buffer keeps the last 2 batches
        batch, bad = decode_batch(got[1][1])
        assert bad == 0 and batch.events == [BlockStored([12], None, [2, 2], 2, medium="GPU")]
        (first,) = _replay_with(zmq.REQ, pub.replay_endpoint, 2)
        assert first[0] == 2
    finally:
        pub.close()


def test_stored_pages_split_into_parent_linked_runs():
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    try:
        pub(Event("stored", (Page(1, None, (1, 2)), Page(2, 1, (3, 4)), Page(7, 5, (9, 9)))))
        pub(Event("removed", (Page(2, 1, (3, 4)), Page(7, 5, (9, 9)))))
        pub(Event("stored", (Page(7, 5, (9, 9)),), "CPU"))   # moved down to the disk tier
        pub(Event("cleared"))
        wait_until(lambda: pub.published_events >= 5, 5, "five events published", interval=0.005)
        events = [e for _, p in _replay_with(zmq.DEALER, pub.replay_endpoint, 0)
                  for e in decode_batch(p)[0].events]
        raw = [msgspec.to_builtins(e) for e in events]
        assert raw == [["BlockStored", [1, 2], None, [1, 2, 3, 4], 2, None, "GPU", None, None, None],
                       ["BlockStored", [7], 5, [9, 9], 2, None, "GPU", None, None, None],
                       ["BlockRemoved", [2, 7], "GPU", None],
                       ["BlockStored", [7], 5, [9, 9], 2, None, "CPU", None, None, None],
                       ["AllBlocksCleared"]]
    finally:
        pub.close()


def test_a_taken_port_is_a_clear_error():
    first = KVEventPublisher("tcp://127.0.0.1:*")
    try:
        with pytest.raises(ValueError, match=f"cannot bind KV events to {first.endpoint}"):
            KVEventPublisher(first.endpoint)
    finally:
        first.close()


def test_the_listener_never_blocks_it_drops_and_counts_past_the_queue_bound():
    pub = KVEventPublisher("tcp://127.0.0.1:*", max_queue=10)
    try:
        pub._stopping = True  # stop the sender: a stalled network, as the engine thread sees it
        pub._wake.set()
        pub._thread.join(5)
        for i in range(25):   # would hang here if the listener waited for room
            pub(Event("stored", (Page(i, None, (i,)),)))
        assert pub.stats()["queued_events"] == 10 and pub.dropped_events == 15
    finally:
        pub.close()


def test_command_line_options_make_a_bound_publisher_or_say_what_is_wrong():
    import argparse

    from app.serve.kv_events_publisher import add_kv_events_args, publisher_from_args
    p = argparse.ArgumentParser()
    add_kv_events_args(p)
    assert publisher_from_args(p.parse_args([])) is None
    with pytest.raises(ValueError, match="--kv-events-replay needs --kv-events"):
        publisher_from_args(p.parse_args(["--kv-events-replay", "5567"]))
    with pytest.raises(ValueError, match="not a ZeroMQ endpoint: 'nowhere'"):
        publisher_from_args(p.parse_args(["--kv-events", "nowhere"]))
    pub = publisher_from_args(p.parse_args(["--kv-events", "127.0.0.1:0", "--kv-events-topic", "kv"]))
    try:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and pub.topic == b"kv"
    finally:
        pub.close()


def test_attaching_to_a_new_cache_clears_the_old_ones_blocks_first():
    from engine import create_prefix_cache
    old, new = create_prefix_cache(), create_prefix_cache()
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*").attach(old)
    try:
        pub.attach(new)
        assert old.listeners == [] and new.listeners == [pub]
        pub(Event("stored", (Page(1, None, (1,)),)))
        assert pub.flush(5)
        replayed = _replay_with(zmq.DEALER, pub.replay_endpoint, 0)
        events = [e for _, p in replayed for e in decode_batch(p)[0].events]
        assert [type(e).__name__ for e in events] == ["AllBlocksCleared", "BlockStored"]
    finally:
        pub.close()
