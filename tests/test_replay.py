"""Replay: the engine's page manager and prefix cache over traces, at any budget and policy."""

from __future__ import annotations

import json
import os

import pytest

from app.replay.results import ReplayConfig
from app.replay.simulate import replay
from app.replay.trace import TraceError, TraceHeader, TraceRequest, open_trace, write_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOONCAKE = os.path.join(ROOT, "resources", "traces", "mooncake", "conversation_trace.jsonl")
BLOCK = 2  # hand-made traces: 2 tokens per hash id


def hand_trace(tmp_path, chains: list[list[int]], name="t.jsonl") -> str:
    """A Mooncake-form trace: each request's full blocks are `chain`, plus one partial block,
    so the one-token-short cap lets it match its whole chain."""
    path = tmp_path / name
    with open(path, "w") as fh:
        for i, chain in enumerate(chains):
            row = {"timestamp": i * 1000, "input_length": BLOCK * len(chain) + 1, "output_length": 1,
                   "hash_ids": chain + [10_000 + i]}
            fh.write(json.dumps(row) + "\n")
    return str(path)


def hits(path: str, budget: int | None, policy: str):
    return replay(open_trace(path, block_size=BLOCK), ReplayConfig(budget=budget, policy=policy))


# the shipped Mooncake trace (docs/design.md §10) ---------------------------------------------------------


def test_mooncake_trace_infinite_capacity_hit_ratio(mooncake_replay):
    r = mooncake_replay(None)
    assert round(r.token_hit_ratio, 4) == 0.3734
    assert r.requests == 12031 and r.page_rows == 512 and r.budget is None and r.evicted == 0
    assert r.tokens_saved == 512 * r.blocks_hit
    assert len(r.over_time) >= 64 and r.over_time[-1]["t"] == pytest.approx(3536.999)


def test_mooncake_trace_hit_ratio_falls_with_capacity(mooncake_replay):
    budgets = (100_000, 30_000, 10_000, 3_000, 1_000)
    ratios = [mooncake_replay(b).token_hit_ratio for b in budgets]
    assert all(a > b for a, b in zip([0.3734] + ratios, ratios)), ratios
    assert [round(x, 4) for x in ratios] == [0.3710, 0.3371, 0.2193, 0.0686, 0.0459]


# policies on hand-made traces -------------------------------------------------------------------


def test_plain_lru_strands_descendants_leaf_lru_keeps_the_prefix(tmp_path):
    # Chain 1-2-3, then 4: over a budget of 3, leaf-LRU drops 3 (the deepest), plain LRU
    # drops 1 (the oldest, the head): 2 and 3 stay cached but cannot be reached.
    path = hand_trace(tmp_path, [[1, 2, 3], [4], [1, 2, 3]])
    leaf = hits(path, 3, "leaf-lru")
    plain = hits(path, 3, "lru")
    assert leaf.blocks_hit == 2 and leaf.hits == 1
    assert plain.blocks_hit == 0 and plain.hits == 0
    assert hits(path, None, "lru").blocks_hit == 3  # with room, the policies agree


def test_fifo_ignores_recency(tmp_path):
    # 1 and 2 are cached, 1 is hit again, then 3 needs room in a budget of 2:
    # LRU drops 2 (the least recently used), FIFO drops 1 (the first inserted).
    path = hand_trace(tmp_path, [[1], [2], [1], [3], [1]])
    assert hits(path, 2, "leaf-lru").blocks_hit == 2   # requests 3 and 5
    assert hits(path, 2, "fifo").blocks_hit == 1       # request 3 only


def test_lfu_keeps_the_most_used_page(tmp_path):
    # 1 is used three times, 2 once and more recently: LFU drops 2, LRU drops 1.
    path = hand_trace(tmp_path, [[1], [1], [1], [2], [3], [1]])
    assert hits(path, 2, "lfu").blocks_hit == 3   # requests 2, 3 and 6
    assert hits(path, 2, "leaf-lru").blocks_hit == 2


def test_leaves_only_policies_never_strand(tmp_path):
    path = hand_trace(tmp_path, [[1, 2, 3], [1, 2, 4], [5, 6], [1, 2, 3]])
    for policy in ("leaf-lru", "lfu", "fifo"):
        assert hits(path, 4, policy).blocks_hit >= 2, policy


# token traces -----------------------------------------------------------------------------------


def test_token_trace_at_other_page_sizes(tmp_path):
    system = list(range(100, 140))  # 40 shared tokens
    reqs = [TraceRequest(arrival_s=i, input_length=45, prompt=system + [i] * 5) for i in range(4)]
    path = str(tmp_path / "s.jsonl")
    write_trace(path, TraceHeader(page_rows=16), reqs)
    src = open_trace(path)
    by_rows = {rows: replay(src, ReplayConfig(page_rows=rows)) for rows in (8, 16, 32)}
    # 40 shared tokens: 5 pages of 8, 2 of 16, 1 of 32, hit by each of the 3 later requests.
    assert {rows: r.tokens_saved for rows, r in by_rows.items()} == {8: 3 * 40, 16: 3 * 32, 32: 3 * 32}
    assert by_rows[16].blocks_hit == 6 and by_rows[16].hits == 3 and by_rows[16].input_tokens == 180


def test_hash_trace_refuses_another_page_size(tmp_path):
    path = hand_trace(tmp_path, [[1]])
    with pytest.raises(ValueError, match="own block size"):
        replay(open_trace(path, block_size=BLOCK), ReplayConfig(page_rows=16))


def test_timed_trace_out_of_admission_order_is_refused(tmp_path):
    reqs = [TraceRequest(arrival_s=0, input_length=3, prompt=[1, 2, 3], admitted_s=2.0, finish_s=3.0),
            TraceRequest(arrival_s=0, input_length=3, prompt=[1, 2, 3], admitted_s=1.0, finish_s=3.0)]
    path = str(tmp_path / "s.jsonl")
    write_trace(path, TraceHeader(page_rows=2), reqs)
    with pytest.raises(TraceError, match="request 2 was admitted before request 1"):
        replay(open_trace(path), ReplayConfig())
