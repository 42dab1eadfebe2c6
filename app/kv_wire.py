"""vLLM's KV-event wire format (docs/design.md §9): the one place that knows its layout.

The publisher (app/serve) and the watcher (app/watch) both import it, so neither imports the other.

A PUB message is three frames: `topic`, `seq` (8-byte big-endian), `payload`
(msgpack). The payload is an `EventBatch` array `[ts, events, data_parallel_rank]`
and each event a tagged array, as vLLM declares them (msgspec, `array_like`,
`tag=True`):

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
     lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...]
    ["BlockRemoved", block_hashes, medium, group_idx]
    ["AllBlocksCleared"]

Decoding is defensive because the layout moved between vLLM versions: trailing
fields are added (`medium`, `lora_name`, `extra_keys`, `group_idx`, ...) and
dropped (`omit_defaults`), hashes are ints or bytes, and vLLM PR #42892 turned
each event into a tagged map (`{"type": "BlockStored", ...}`) while the batch
stayed an array. The typed fast path reads arrays; anything it refuses goes
through a generic path that reads arrays and maps by position or by name.
Whatever neither can read raises `BadFrame`.

The replay protocol: a REQ or DEALER sends the start seq as 8 bytes (after an
empty delimiter frame); the publisher's ROUTER answers `(seq, payload)` per
buffered batch from there, then `(END_SEQ, b"")`.
"""

from __future__ import annotations

import time
from typing import Any, Union

import msgspec

BlockHash = Union[int, bytes]  # noqa: UP007 - msgspec needs a runtime union object
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM = "CPU"  # PrefixLab's pages live in host memory (vLLM publishes "GPU" for its own)


class BadFrame(ValueError):
    """A message that is not a KV-event batch in any layout this module reads."""


class BlockStored(msgspec.Struct, array_like=True, gc=False, tag=True):
    """Blocks stored as one chain: block i's parent is block i-1, block 0's `parent_block_hash`."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Any = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, array_like=True, gc=False, tag=True):
    """Blocks evicted (any order; a parent may go before its children)."""

    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, array_like=True, gc=False, tag=True):
    """The engine dropped its whole prefix cache."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]  # noqa: UP007
_EVENT_TYPES = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    """One published batch: its wall-clock time, its events and the publisher's DP rank."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_typed = msgspec.msgpack.Decoder(KVEventBatch)
_generic = msgspec.msgpack.Decoder()
_encoder = msgspec.msgpack.Encoder()


# encoding ---------------------------------------------------------------
def stored_event(block_hashes, parent, token_ids, block_size: int, medium: str | None = MEDIUM) -> list:
    """A `BlockStored` in vLLM's array layout (up to `lora_name`, as vLLM 0.11 to 0.2x sends it)."""
    return ["BlockStored", list(block_hashes), parent, list(token_ids), int(block_size), None, medium, None]


def removed_event(block_hashes, medium: str | None = MEDIUM) -> list:
    """A `BlockRemoved` in vLLM's array layout."""
    return ["BlockRemoved", list(block_hashes), medium]


def cleared_event() -> list:
    """An `AllBlocksCleared` in vLLM's array layout."""
    return ["AllBlocksCleared"]


def encode_batch(events: list, ts: float | None = None, data_parallel_rank: int | None = 0) -> bytes:
    """The msgpack payload of one batch of events built by the functions above."""
    return _encoder.encode([time.time() if ts is None else ts, events, data_parallel_rank])


def normalize_endpoint(text: str) -> str:
    """A ZeroMQ endpoint from what a user types: `tcp://h:p` as is, `h:p` and a bare port as tcp."""
    text = text.strip()
    if "://" in text:
        return text
    if text.isdigit():
        return f"tcp://127.0.0.1:{text}"
    host, sep, port = text.rpartition(":")
    if sep and port.isdigit():
        return f"tcp://{host or '127.0.0.1'}:{port}"
    raise ValueError(f"not a ZeroMQ endpoint: {text!r} (use tcp://127.0.0.1:5557, 127.0.0.1:5557 or 5557)")


def seq_bytes(seq: int) -> bytes:
    """A sequence number as the 8-byte big-endian frame (signed: the replay end marker is -1)."""
    return seq.to_bytes(8, "big", signed=True)


# decoding ---------------------------------------------------------------
def parse_seq(frame: bytes) -> int:
    """The 8-byte big-endian sequence number of a frame."""
    if len(frame) != 8:
        raise BadFrame(f"sequence frame has {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)


def split_message(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """(topic, seq, payload) of a PUB message; BadFrame when it is not three frames."""
    if len(frames) != 3:
        raise BadFrame(f"message has {len(frames)} frames, expected 3 (topic, seq, payload)")
    return frames[0], parse_seq(frames[1]), frames[2]


def decode_batch(payload: bytes) -> tuple[KVEventBatch, int]:
    """The batch in a payload and how many of its events were unreadable (skipped)."""
    try:
        return _typed.decode(payload), 0
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass
    try:
        raw = _generic.decode(payload)
    except (msgspec.DecodeError, ValueError, RecursionError) as e:
        raise BadFrame(f"payload is not msgpack: {e}") from None
    return _batch_from_raw(raw)


def _batch_from_raw(raw: Any) -> tuple[KVEventBatch, int]:
    if isinstance(raw, dict):  # a batch struct without array_like
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or len(raw) < 2:
        raise BadFrame("payload is not an event batch [ts, events, ...]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(events, list):
        raise BadFrame("event batch needs a number ts and a list of events")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        rank = None
    out, bad = [], 0
    for ev in events:
        try:
            out.append(_event_from_raw(ev))
        except (BadFrame, msgspec.ValidationError, TypeError):
            bad += 1
    return KVEventBatch(float(ts), out, rank), bad


def _event_from_raw(ev: Any) -> KVEvent:
    if isinstance(ev, dict):  # vLLM >= PR #42892: a tagged map, fields by name
        cls = _EVENT_TYPES.get(ev.get("type"))
        if cls is None:
            raise BadFrame(f"unknown event type {ev.get('type')!r}")
        values = []
        for f in msgspec.structs.fields(cls):
            if f.name in ev:
                values.append(ev[f.name])
            elif f.required:
                raise BadFrame(f"{cls.__name__} without {f.name}")
            else:
                values.append(f.default_factory() if f.default is msgspec.NODEFAULT else f.default)
        ev = [cls.__name__, *values]
    elif not (isinstance(ev, list) and ev and isinstance(ev[0], str)):
        raise BadFrame("an event is a tagged array or a tagged map")
    cls = _EVENT_TYPES.get(ev[0])
    if cls is None:
        raise BadFrame(f"unknown event type {ev[0]!r}")
    # convert() applies the typed path's checks; extra trailing fields are ignored.
    return msgspec.convert(ev, cls)
