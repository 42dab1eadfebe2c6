"""Clusters in replay: N replicas behind six routers, exact hit ratios, the service model, the CLI."""

from __future__ import annotations

import itertools
import json
import os

import pytest

from app.cli import main
from app.replay.cluster import ClusterConfig, ServiceModel, replay_cluster
from app.replay.cluster_cli import cluster_configs
from app.replay.routers import ROUTERS, RouterKnobs
from app.replay.sweep import run_sweep
from app.replay.synth import synthesize
from app.replay.trace import open_trace

MOONCAKE = os.path.join(os.path.dirname(__file__), "..", "resources", "traces", "mooncake",
                        "conversation_trace.jsonl")
SERVICE = ServiceModel(prefill_rate=20_000.0, decode_rate=40.0, slots=4)
RATES = ["--prefill-rate", "20000", "--decode-rate", "40", "--slots", "4"]


@pytest.fixture(scope="module")
def mooncake_head(tmp_path_factory) -> str:
    """The conversation trace's first 800 requests."""
    path = tmp_path_factory.mktemp("trace") / "head.jsonl"
    with open(MOONCAKE, encoding="utf-8") as src:
        path.write_text("".join(itertools.islice(src, 800)))
    return str(path)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("synth") / "synth.jsonl")
    synthesize(600, path, seed=7)
    return path


def independent(path: str, replicas: int, router: str, budget: int, block: int = 512) -> list[int]:
    """Tokens saved per replica, by docs/design.md §10/§13 written out plainly: a dict per replica
    of block id -> [last use, parent], the longest cached prefix capped one token short, full blocks
    inserted, least recently used leaves evicted down to the budget after each request."""
    caches: list[dict] = [{} for _ in range(replicas)]
    saved = [0] * replicas
    clock = itertools.count()
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            r = json.loads(line)
            ids, n = r["hash_ids"], r["input_length"]
            k = i % replicas if router == "round-robin" else ids[0] % replicas
            c = caches[k]
            m = 0
            while m < (n - 1) // block and ids[m] in c:
                m += 1
            for h in ids[:m]:
                c[h][0] = next(clock)
            for j, h in enumerate(ids[:n // block]):
                if h in c:
                    c[h][0] = next(clock)
                else:
                    c[h] = [next(clock), ids[j - 1] if j else None]
            while len(c) > budget:
                parents = {v[1] for v in c.values()}
                del c[min((h for h in c if h not in parents), key=lambda h: c[h][0])]
            saved[k] += m * block
    return saved


@pytest.mark.parametrize("router", ["round-robin", "prefix-hash"])
@pytest.mark.parametrize("trace", ["mooncake_head", "synthetic"])
def test_round_robin_and_prefix_hash_are_exact(router, trace, request):
    """Routers blind to load: prefix-hash without its overflow (`--hash-balance 0`), the hash alone."""
    path = request.getfixturevalue(trace)
    src = open_trace(path)
    for replicas in (1, 2, 4):
        res = replay_cluster(src, ClusterConfig(replicas, router, SERVICE, budget=120,
                                                knobs=RouterKnobs(hash_balance=0)))
        expected = independent(path, replicas, router, 120)
        assert [p["tokens_saved"] for p in res.per_replica] == expected
        assert res.tokens_saved == sum(expected) > 0
        assert res.requests == sum(p["requests"] for p in res.per_replica)


def test_cache_aware_routing_keeps_prefixes_together(synthetic):
    """Spreading a Zipf workload round-robin splits every shared prefix over all replicas; the
    cache-aware and kv-cost routers send a prefix where it is cached and hit far more."""
    src = open_trace(synthetic)
    got = {r: replay_cluster(src, ClusterConfig(4, r, SERVICE, budget=150)) for r in ROUTERS}
    for smart in ("cache-aware", "kv-cost"):
        assert got[smart].token_hit_ratio > got["round-robin"].token_hit_ratio + 0.05
    assert got["least-loaded"].load_imbalance < 1.1
    for r in got.values():
        assert 0 < r.ttft_p50_s <= r.ttft_p99_s
        assert len(r.per_replica) == 4 and r.load_imbalance >= 1.0
    # one replica: every router is the same machine
    one = {replay_cluster(src, ClusterConfig(1, r, SERVICE, budget=150)).tokens_saved for r in ROUTERS}
    assert len(one) == 1


def test_more_replicas_cut_queueing(synthetic):
    src = open_trace(synthetic)
    slow = ServiceModel(prefill_rate=5_000.0, decode_rate=20.0, slots=2)
    p99 = [replay_cluster(src, ClusterConfig(n, "least-loaded", slow)).ttft_p99_s for n in (1, 2, 4)]
    assert p99[0] > p99[1] > p99[2]


def test_pool_and_dask_local_cluster_give_the_same_numbers(synthetic):
    distributed = pytest.importorskip("dask.distributed")
    src = open_trace(synthetic)
    configs = cluster_configs([1, 3], list(ROUTERS), [200], ["leaf-lru"], [None], SERVICE,
                              RouterKnobs(seed=3))
    seen = []
    pool = run_sweep(src, configs, workers=2, fn=replay_cluster, progress=lambda d, t: seen.append((d, t)))
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=":0") as cluster:
        dask = run_sweep(src, configs, dask_scheduler=cluster.scheduler_address, fn=replay_cluster)

    def numbers(results):
        return [(r.replicas, r.router, r.tokens_saved, r.load_imbalance, r.ttft_p50_s, r.ttft_p99_s,
                 r.per_replica) for r in results]
    assert numbers(pool) == numbers(dask)
    assert seen[-1] == (12, 12)


def test_synthesize_is_seeded_mooncake(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert main(["replay", "--synthesize", "300", str(a), "--seed", "5"]) == 0
    assert "300 requests" in capsys.readouterr().out
    synthesize(300, str(b), seed=5)
    assert a.read_bytes() == b.read_bytes()
    src = open_trace(str(a))
    assert src.format == "mooncake" and sum(1 for _ in src) == 300
    rows = [json.loads(line) for line in a.read_text().splitlines()]
    assert all(r["timestamp"] <= s["timestamp"] for r, s in zip(rows, rows[1:]))
    firsts = [r["hash_ids"][0] for r in rows]
    assert len(set(firsts)) < len(firsts) / 2  # Zipf: a few prefixes carry most requests


def test_cli_cluster_table_json_and_plot(synthetic, tmp_path, capsys):
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    assert main(["replay", synthetic, "--replicas", "1,2", "--router", "round-robin,cache-aware",
                 "--budget", "200", *RATES, "--json", str(out), "--plot", str(png), "--workers", "1",
                 "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "prefill 20,000.0 tok/s" in text and "TTFT p99 s" in text and "cache-aware" in text
    rows = json.loads(out.read_text())["rows"]
    assert [(r["replicas"], r["router"]) for r in rows] == [
        (1, "round-robin"), (1, "cache-aware"), (2, "round-robin"), (2, "cache-aware")]
    expected = independent(synthetic, 2, "round-robin", 200)
    assert [p["tokens_saved"] for p in rows[2]["per_replica"]] == expected
    assert f"{rows[2]['token_hit_ratio']:.4f}" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bad_cluster_input(synthetic, tmp_path, capsys):
    for argv, words in ((["--router", "fastest"], "unknown router 'fastest'"),
                        (["--replicas", "0"], "at least 1 replica"),
                        (["--replicas", "2", "--prefill-rate", "0"], "rate is a number of tokens/s > 0"),
                        (["--replicas", "2", "--slots", "0"], "expected an integer >= 1"),
                        (["--replicas", "2", "--hash-balance", "0.5"], "0 (never overflow) or a factor"),
                        (["--replicas", "2", "--hash-balance", "nan"], "0 (never overflow) or a factor")):
        with pytest.raises(SystemExit):
            main(["replay", synthetic, *argv])
        assert words in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    lines = open(synthetic, encoding="utf-8").read().splitlines()[:5]
    bad.write_text("\n".join(lines[:3] + ["{not json"] + lines[3:]) + "\n")
    with pytest.raises(SystemExit, match=r"bad\.jsonl, line 4: not valid JSON"):
        main(["replay", str(bad), "--replicas", "2", *RATES, "--quiet", "--workers", "1", "--strict"])


def test_default_rates_are_measured_once_and_printed(synthetic, tiny_gguf_path, capsys):
    """Without --prefill-rate/--decode-rate/--slots, the replay measures the engine once (here a tiny
    model), prints the rates with the results, and reads them back the next time."""
    argv = ["replay", synthetic, "--replicas", "2", "--router", "least-loaded", "--model", tiny_gguf_path,
            "--workers", "1", "--quiet"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert "(measured now with" in first
    assert main(argv) == 0
    second = capsys.readouterr().out
    assert "engine-rates.json)" in second
    rates = [line for line in first.splitlines() if line.startswith("service model per replica")]
    assert rates and rates[0].split(" (")[0] == next(
        line for line in second.splitlines() if line.startswith("service model")).split(" (")[0]
    assert ", 8 slots" in rates[0]


def test_token_trace_prefix_hash_keeps_each_system_prompt_on_one_replica(tmp_path):
    """A token trace: prefix-hash routes by the first page's chained key, so every request of one of
    four system prompts lands where its prefix is cached and 3 replicas hit like one big cache."""
    from app.replay.results import ReplayConfig
    from app.replay.simulate import replay
    from app.replay.trace import TraceHeader, TraceRequest, write_trace
    reqs = []
    for i in range(30):
        system = [t + 1000 * (i % 4) for t in range(100, 148)]
        reqs.append(TraceRequest(arrival_s=float(i), input_length=54, output_length=4,
                                 prompt=system + [i, i + 1, i + 2, 7, 8, 9]))
    path = str(tmp_path / "tokens.jsonl")
    write_trace(path, TraceHeader(page_rows=8, source="test"), reqs)
    src = open_trace(path)
    one = replay(src, ReplayConfig())
    hashed = replay_cluster(src, ClusterConfig(3, "prefix-hash", SERVICE))
    spread = replay_cluster(src, ClusterConfig(3, "round-robin", SERVICE))
    assert hashed.tokens_saved == one.tokens_saved == 26 * 48  # four misses: each prompt's first
    assert spread.tokens_saved < hashed.tokens_saved


def test_no_model_to_measure_rates_says_what_to_give(synthetic, tmp_path):
    with pytest.raises(SystemExit, match="give --prefill-rate, --decode-rate and --slots"):
        main(["replay", synthetic, "--replicas", "2", "--model", str(tmp_path / "missing.gguf"), "--quiet"])
