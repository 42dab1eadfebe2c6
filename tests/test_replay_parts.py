"""Where every prompt token went in replay and clusters (docs/design.md §15): totals by part per
configuration on the shipped Mooncake trace, and `routed` per router on 4 replicas."""

from __future__ import annotations

import json
import os

from app.cli import main
from app.replay.cluster import ClusterConfig, ServiceModel, replay_cluster
from app.replay.results import ReplayConfig
from app.replay.simulate import replay
from app.replay.trace import open_trace
from engine.token_parts import PARTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOONCAKE = os.path.join(ROOT, "resources", "traces", "mooncake", "conversation_trace.jsonl")
PROMPT_TOKENS = 144_793_823   # the trace's input_length, summed
ROUTERS = ("round-robin", "prefix-hash", "random", "least-loaded", "cache-aware", "kv-cost")
BLOCK = 512
HEAD_REQUESTS = 5_000


def added(parts: dict) -> int:
    return sum(parts[p] for p in parts if p != "disk")


def test_mooncake_totals_by_part_at_two_budgets(mooncake_replay):
    small, large = mooncake_replay(3_000), mooncake_replay(30_000)
    for r in (small, large):
        assert added(r.parts) == r.input_tokens == PROMPT_TOKENS
        assert r.parts["cached"] == r.tokens_saved
        assert r.parts["rounding"] == r.parts["lent"] == r.parts["isolated"] == r.parts["disk"] == 0
        assert r.seen_pages >= 182_790   # the index reaches over every distinct block of the trace
    # what a larger budget keeps was evicted at the smaller one; what no request had is the same
    assert small.parts == {"cached": 9_934_848, "disk": 0, "lent": 0, "rounding": 0, "cap": 0,
                           "evicted": 44_128_256, "isolated": 0, "new": 90_730_719}
    assert large.parts["new"] == small.parts["new"]
    assert large.parts["evicted"] < small.parts["evicted"]


def test_hand_trace_repeat_is_cached_but_the_cap_and_a_gone_one_is_evicted(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [([1, 2, 3], 3 * BLOCK), ([1, 2, 3], 3 * BLOCK), ([7, 8], 2 * BLOCK), ([1, 2, 3], 3 * BLOCK - 5)]
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": n, "output_length": 1,
                                        "hash_ids": ids}) + "\n" for i, (ids, n) in enumerate(rows)))
    r = replay(open_trace(str(path)), ReplayConfig(budget=3))
    # 1: new; 2: an exact repeat, two blocks cached and the third held but capped; 3: new, and
    # its insert evicts blocks 3 and 2 down to the budget; 4: block 1 cached, 2 and 3 evicted
    assert r.parts == {"cached": 3 * BLOCK, "disk": 0, "lent": 0, "rounding": 0, "cap": BLOCK,
                       "evicted": 2 * BLOCK - 5, "isolated": 0, "new": 5 * BLOCK}


def test_routed_per_router_on_four_replicas(tmp_path):
    # the trace's first 5,000 requests (of 12,031): the routers' ranking is set by then
    head = tmp_path / "head.jsonl"
    with open(MOONCAKE, encoding="utf-8") as src, open(head, "w", encoding="utf-8") as dst:
        lines = [line for _, line in zip(range(HEAD_REQUESTS), src)]
        dst.writelines(lines)
    prompt_tokens = sum(json.loads(line)["input_length"] for line in lines)
    src = open_trace(str(head))
    service = ServiceModel(prefill_rate=20_000.0, decode_rate=40.0, slots=4)
    res = {r: replay_cluster(src, ClusterConfig(4, r, service, budget=3_000)) for r in ROUTERS}
    for r in res.values():
        assert r.requests == HEAD_REQUESTS
        assert sum(r.parts[p] for p in (*PARTS, "routed")) == prompt_tokens
        assert r.parts["cached"] == r.tokens_saved
    routed = {name: r.parts["routed"] for name, r in res.items()}
    # every request of this trace starts with the same block: prefix-hash keeps it on the hash's
    # replica only up to 1.25x the mean load, then overflows in hash order, so load stays spread
    # and the hot prefix is held by several replicas (a plain hash put all on one: imbalance 4)
    assert res["prefix-hash"].load_imbalance < 1.3
    assert res["prefix-hash"].token_hit_ratio > res["round-robin"].token_hit_ratio
    # the router that reads every replica's cache regrets the fewest tokens, by far
    assert min(routed, key=routed.get) == "cache-aware", routed
    assert routed["cache-aware"] * 1000 < min(v for k, v in routed.items() if k != "cache-aware")


def test_prefix_hash_overflows_in_hash_order_past_its_balance():
    from app.replay.routers import RouterKnobs, View, make_router
    route = make_router("prefix-hash", 4, RouterKnobs(hash_balance=1.25))

    def view(first_key: int, load: list[float], tokens: int = 100) -> View:
        return View(index=0, first_key=first_key, blocks=1, tokens=tokens, cached=[], load=load,
                    decoding=[0] * 4)
    assert route(view(6, [0, 0, 0, 0])) == 2             # idle: the hash's replica (6 mod 4)
    # bound = 1.25 x (1,000 + 100) / 4 = 343.75: replica 2 (400 + 100) is over it, 3 (300 + 100)
    # too, 0 (200 + 100) is not: the next in hash order, not the least loaded (1)
    assert route(view(6, [200, 100, 400, 300])) == 0
    assert route(view(6, [300, 300, 200, 300])) == 2     # within the bound: stays home
    # no replica within the bound (one large request): the least loaded
    assert route(view(6, [100, 50, 100, 100], tokens=10_000)) == 1
    never = make_router("prefix-hash", 4, RouterKnobs(hash_balance=0))
    assert never(view(6, [0, 0, 10**9, 0])) == 2         # 0: the hash alone, whatever the load


def test_the_replay_table_and_json_give_the_parts(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["replay", MOONCAKE, "--budget", "3000", "--quiet", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "where the prompt tokens went" in text and "144,793,823" in text
    row = json.loads(out.read_text())["rows"][0]
    assert added(row["parts"]) == PROMPT_TOKENS and row["parts"]["evicted"] == 44_128_256
