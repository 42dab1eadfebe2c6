"""One serving engine's prefix cache rebuilt from its KV events, and the view across engines.

Qt-free: the CLI prints and dumps it, the app reads `snapshot()` from its own
thread (the watcher holds a lock around every batch it applies).

Blocks are kept per tier `(medium, group_idx)`: vLLM with CPU offloading stores
the same hash on "GPU" and "CPU", and a hybrid model the same hash in several
KV-cache groups; a removal names its tier. Each engine keeps at most
`max_blocks` blocks: stores past the cap are counted in `over_cap` and not kept
(their children then show as orphans), so a runaway feed cannot exhaust memory.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field

from app.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

DEFAULT_MAX_BLOCKS = 250_000   # ~100 MB of blocks with 16 token ids each
HISTORY_POINTS = 3_600         # per-batch points kept for the charts


class Block:
    """A live block: its hash, its parent's hash and its token ids (None when not sent)."""

    __slots__ = ("hash", "parent", "tokens", "seq")

    def __init__(self, h, parent, tokens, seq):
        self.hash, self.parent, self.tokens, self.seq = h, parent, tokens, seq


@dataclass
class Counters:
    """What the feed did: the JSON's per-engine numbers."""

    batches: int = 0
    stored_blocks: int = 0       # distinct blocks stored (a block stored twice counts once)
    removed_blocks: int = 0      # live blocks removed
    cleared: int = 0             # AllBlocksCleared events
    bad_frames: int = 0          # messages that are not a KV-event batch (skipped)
    bad_events: int = 0          # unreadable events inside a readable batch (skipped)
    seq_gaps: int = 0            # jumps forward in the sequence numbers
    missed_batches: int = 0      # batches those gaps skipped
    repaired_batches: int = 0    # of those, batches fetched from the replay socket
    duplicate_stores: int = 0    # stores of a hash already live
    unknown_removes: int = 0     # removals of a hash not live (never seen, or over the cap)
    over_cap: int = 0            # stores not kept: the engine was at max_blocks
    epochs: int = 1              # engine (re)starts seen: seq back to 0
    disconnects: int = 0         # connections ZeroMQ dropped (also: a frame over the size limit)


@dataclass
class BatchResult:
    """What one batch changed: the line the CLI prints."""

    engine: int
    seq: int
    stored: int
    removed: int
    cleared: int
    live: int
    bad_events: int
    replayed: bool = False


def hash_json(h):
    """A block hash as JSON: an int stays an int, bytes become a hex string."""
    return h.hex() if isinstance(h, bytes) else h


@dataclass
class EngineState:
    """The blocks and counters of one engine (one endpoint: an instance or a DP rank)."""

    index: int
    endpoint: str
    max_blocks: int = DEFAULT_MAX_BLOCKS
    block_size: int | None = None
    tiers: dict = field(default_factory=dict)      # (medium, group_idx) -> {hash: Block}
    counters: Counters = field(default_factory=Counters)
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY_POINTS))
    data_parallel_rank: int | None = None
    topic: bytes = b""
    last_seq: int | None = None
    last_ts: float | None = None
    joined_at_seq: int | None = None               # first seq seen when history before it was missed
    live: int = 0

    def name(self) -> str:
        """"engine 0 (tcp://host:5557 dp0)": how the CLI and the app name this engine."""
        rank = "" if self.data_parallel_rank is None else f" dp{self.data_parallel_rank}"
        return f"engine {self.index} ({self.endpoint}{rank})"

    # applying events -----------------------------------------------------
    def apply(self, seq: int, batch: KVEventBatch, bad_events: int = 0,
              replayed: bool = False) -> BatchResult:
        """Apply one batch's events in order; return what changed."""
        c = self.counters
        c.batches += 1
        c.bad_events += bad_events
        stored = removed = cleared = 0
        for ev in batch.events:
            if type(ev) is BlockStored:
                stored += self._store(ev, seq)
            elif type(ev) is BlockRemoved:
                removed += self._remove(ev)
            elif type(ev) is AllBlocksCleared:
                cleared += 1
                self.clear()
        c.stored_blocks += stored
        c.removed_blocks += removed
        c.cleared += cleared
        self.last_seq, self.last_ts = seq, batch.ts
        if batch.data_parallel_rank is not None:
            self.data_parallel_rank = batch.data_parallel_rank
        self.history.append((batch.ts, c.stored_blocks, c.removed_blocks, self.live))
        return BatchResult(self.index, seq, stored, removed, cleared, self.live, bad_events, replayed)

    def _store(self, ev: BlockStored, seq: int) -> int:
        blocks = self.tiers.setdefault((ev.medium, ev.group_idx), {})
        size = ev.block_size if ev.block_size > 0 else (self.block_size or 0)
        toks = ev.token_ids
        parent, new = ev.parent_block_hash, 0
        for i, h in enumerate(ev.block_hashes):
            if h in blocks:
                self.counters.duplicate_stores += 1
            elif self.live >= self.max_blocks:
                self.counters.over_cap += 1
            else:
                part = tuple(toks[i * size:(i + 1) * size]) if size and len(toks) >= (i + 1) * size else None
                blocks[h] = Block(h, parent, part, seq)
                self.live += 1
                new += 1
            parent = h
        return new

    def _remove(self, ev: BlockRemoved) -> int:
        blocks = self.tiers.get((ev.medium, ev.group_idx), {})
        gone = 0
        for h in ev.block_hashes:
            if blocks.pop(h, None) is None:
                self.counters.unknown_removes += 1
            else:
                gone += 1
        self.live -= gone
        return gone

    def clear(self) -> None:
        """Drop every block (AllBlocksCleared, or an engine restart)."""
        self.tiers.clear()
        self.live = 0

    def new_epoch(self) -> None:
        """The engine restarted (seq went back): its cache starts empty."""
        self.clear()
        self.counters.epochs += 1

    # reading -------------------------------------------------------------
    def blocks(self):
        """Every live block as (tier, Block)."""
        for tier, blocks in self.tiers.items():
            for b in blocks.values():
                yield tier, b

    def block_hashes(self) -> set:
        """The set of live block hashes (all tiers)."""
        return {b.hash for _, b in self.blocks()}

    def _trees(self):
        """Each tree of blocks: (tier, root, [(block hash, depth, is a leaf)] in depth-first order)."""
        for tier, blocks in self.tiers.items():
            children: dict = {}
            roots = []
            for b in blocks.values():
                if b.parent is not None and b.parent in blocks:
                    children.setdefault(b.parent, []).append(b.hash)
                else:
                    roots.append(b)
            for root in roots:  # blocks linked in a cycle have no root: not shown
                order, stack = [], [(root.hash, 1)]
                while stack:
                    h, d = stack.pop()
                    kids = children.get(h, ())
                    order.append((h, d, not kids))
                    stack.extend((k, d + 1) for k in kids)
                yield tier, root, order

    def chains(self) -> list[dict]:
        """The cached prefixes as trees: one entry per root (a block with no live parent), biggest first."""
        out = [{"root": hash_json(root.hash), "medium": tier[0], "group_idx": tier[1],
                "orphan": root.parent is not None, "blocks": len(order),
                "leaves": sum(leaf for _, _, leaf in order), "depth": max(d for _, d, _ in order),
                "first_tokens": list(root.tokens or ())}
               for tier, root, order in self._trees()]
        out.sort(key=lambda c: -c["blocks"])
        return out

    def block_cells(self, limit: int = 20_000) -> list[int]:
        """For a block map: the trees biggest first, each block's tree rank (0, 1, ...) in tree order."""
        trees = sorted((order for _, _, order in self._trees()), key=lambda o: -len(o))
        cells: list[int] = []
        for rank, order in enumerate(trees):
            cells.extend([rank] * min(len(order), limit - len(cells)))
            if len(cells) >= limit:
                break
        return cells

    def summary(self) -> dict:
        """The counters and identity of this engine as plain data."""
        d = {"engine": self.index, "endpoint": self.endpoint, "data_parallel_rank": self.data_parallel_rank,
             "topic": self.topic.decode("utf-8", "replace"), "live_blocks": self.live,
             "last_seq": self.last_seq, "last_ts": self.last_ts, "joined_at_seq": self.joined_at_seq,
             "max_blocks": self.max_blocks}
        d.update(vars(self.counters))
        d["tiers"] = {f"{m}/{g}": len(b) for (m, g), b in self.tiers.items()}
        return d

    def to_json(self, with_blocks: bool = True) -> dict:
        """The engine's final state: counters, chains and (optionally) every block."""
        d = self.summary()
        d["chains"] = self.chains()
        if with_blocks:
            d["blocks"] = [{"hash": hash_json(b.hash), "parent": hash_json(b.parent), "medium": t[0],
                            "group_idx": t[1], "tokens": list(b.tokens) if b.tokens is not None else None}
                           for t, b in self.blocks()]
        return d


def _content_keys(state: EngineState) -> dict:
    """block hash -> (key of the token prefix it caches, depth), to compare engines with other hash seeds.

    A block whose tokens or parent chain are unknown is keyed by its own hash.
    """
    keys: dict = {}
    for blocks in state.tiers.values():
        for b in blocks.values():
            path, on_path, cur = [], set(), b
            while cur is not None and cur.hash not in keys and cur.hash not in on_path:
                path.append(cur)
                on_path.add(cur.hash)  # a hostile feed may link parents in a cycle
                cur = blocks.get(cur.parent) if cur.parent is not None else None
            for blk in reversed(path):
                up = keys.get(blk.parent) if blk.parent is not None else ("root", 0)
                if blk.tokens is None or up is None or isinstance(up[0], tuple):
                    keys[blk.hash] = (("hash", blk.hash), 1 if up is None else up[1] + 1)
                    continue
                data = f"{up[0]}|{blk.tokens}".encode()
                keys[blk.hash] = (hashlib.blake2b(data, digest_size=8).hexdigest(), up[1] + 1)
    return keys


def cross_engine(states: list[EngineState], top: int = 20) -> dict:
    """Which cached prefixes live on several engines: the duplication a KV-aware router avoids."""
    where: dict = {}
    depth: dict = {}
    for s in states:
        for key, d in _content_keys(s).values():
            where.setdefault(key, set()).add(s.index)
            depth[key] = d
    shared = {k: e for k, e in where.items() if len(e) > 1}
    pairs: dict = {}
    for e in shared.values():
        name = ",".join(str(i) for i in sorted(e))
        pairs[name] = pairs.get(name, 0) + 1
    deepest = sorted(shared, key=lambda k: -depth[k])[:top]
    return {"shared_blocks": len(shared), "by_engines": pairs,
            "deepest": [{"engines": sorted(shared[k]), "depth_blocks": depth[k]} for k in deepest]}
