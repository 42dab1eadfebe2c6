"""`prefixlab replay`: sweeps in processes and on a Dask cluster, the table, JSON, PNG, redaction."""

from __future__ import annotations

import json

import pytest

import engine
from app.cli import main
from app.replay.results import ReplayConfig
from app.replay.simulate import replay
from app.replay.sweep import configurations, run_sweep
from app.replay.trace import TraceHeader, TraceRequest, open_trace, write_trace

SYSTEM = list(range(100, 148))  # 48 shared tokens


def token_trace(tmp_path, n=12) -> str:
    """Requests over three system prompts, the first one hot: budgets and policies matter."""
    reqs = []
    for i in range(n):
        system = [t + 1000 * (0, 1, 0, 2)[i % 4] for t in SYSTEM]
        reqs.append(TraceRequest(arrival_s=float(i), input_length=len(system) + 6, output_length=4,
                                 prompt=system + [i, i + 1, i + 2, 7, 8, 9]))
    path = str(tmp_path / "session.jsonl")
    write_trace(path, TraceHeader(page_rows=8, source="test"), reqs)
    return path


def figures(results) -> list[tuple]:
    return [(r.page_rows, r.budget, r.policy, r.tokens_saved, r.blocks_hit, r.hits, r.evicted)
            for r in results]


def test_sweep_in_processes_matches_one_by_one(tmp_path):
    src = open_trace(token_trace(tmp_path))
    configs = configurations([8, 16], [None, 12], ["leaf-lru", "fifo"])
    assert len(configs) == 8 and configs[0] == ReplayConfig(8, None, "leaf-lru")
    seen = []
    results = run_sweep(src, configs, workers=2, progress=lambda done, total: seen.append((done, total)))
    assert figures(results) == figures([replay(src, c) for c in configs])
    assert seen[-1] == (8, 8)
    assert results[0].tokens_saved > results[2].tokens_saved > 0  # 12 pages hold two of three prompts


def test_sweep_on_a_dask_local_cluster(tmp_path):
    distributed = pytest.importorskip("dask.distributed")
    src = open_trace(token_trace(tmp_path))
    configs = configurations([8], [None, 4, 8], ["leaf-lru", "lru"])
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                                  dashboard_address=":0") as cluster:
        results = run_sweep(src, configs, dask_scheduler=cluster.scheduler_address)
    assert figures(results) == figures([replay(src, c) for c in configs])


def test_cli_table_json_and_plot(tmp_path, capsys):
    trace = token_trace(tmp_path)
    out, png = tmp_path / "rows.json", tmp_path / "curve.png"
    assert main(["replay", trace, "--page-rows", "8", "--budget", "inf,4,8", "--policy", "leaf-lru,fifo",
                 "--json", str(out), "--plot", str(png), "--workers", "1", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "hit ratio" in text and "leaf-lru" in text and "fifo" in text
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert doc["format"] == "prefixlab" and len(rows) == 6
    assert {(r["budget"], r["policy"]) for r in rows} == {
        (b, p) for b in (None, 4, 8) for p in ("leaf-lru", "fifo")}
    inf = next(r for r in rows if r["budget"] is None and r["policy"] == "leaf-lru")
    assert inf["page_rows"] == 8 and inf["requests"] == 12 and inf["tokens_saved"] == 9 * 48
    assert inf["token_hit_ratio"] == pytest.approx(9 * 48 / (12 * 54))
    assert f"{inf['token_hit_ratio']:.4f}" in text
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_cli_bad_trace_and_bad_options(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n'
                   '{"timestamp": 0, "input_length": 600, "output_length": 1}\n')
    with pytest.raises(SystemExit, match=r"line 2: missing field 'hash_ids'"):
        main(["replay", str(bad), "--quiet", "--strict"])
    with pytest.raises(SystemExit):
        main(["replay", str(bad), "--budget", "-3"])
    with pytest.raises(SystemExit, match="--page-rows applies to token traces"):
        main(["replay", str(bad), "--page-rows", "16"])


def test_redacted_trace_replays_like_the_tokens(tmp_path, capsys):
    """The Mooncake form keeps what the cache needs: replayed at block = page size, same hits."""
    trace = token_trace(tmp_path)
    redacted = tmp_path / "redacted.jsonl"
    assert main(["replay", trace, "--redact", str(redacted)]) == 0
    lines = [json.loads(line) for line in redacted.read_text().splitlines()]
    assert set(lines[0]) == {"timestamp", "input_length", "output_length", "hash_ids"}
    assert all(len(r["hash_ids"]) == 7 for r in lines) and lines[0]["hash_ids"] == list(range(7))
    tokens = replay(open_trace(trace), ReplayConfig(page_rows=8, budget=6))
    hashed = replay(open_trace(str(redacted), block_size=8), ReplayConfig(budget=6))
    assert figures([hashed])[0][3:] == figures([tokens])[0][3:]


def test_openai_log_is_tokenized_with_the_model_template(tiny_gguf_path, tmp_path, capsys):
    """A multi-turn history shares its pages: turn 2 hits turn 1's whole prompt, not just the system."""
    system = {"role": "system", "content": "You answer questions about the hardware store, briefly."}
    turn1 = [system, {"role": "user", "content": "Do you sell hammers and nails?"}]
    turn2 = turn1 + [{"role": "assistant", "content": "Yes, aisle four."},
                     {"role": "user", "content": [{"type": "text", "text": "And screws?"}]}]
    other = [system, {"role": "user", "content": "Are you open today?"}]
    log = tmp_path / "requests.jsonl"
    log.write_text("".join(json.dumps({"model": "gpt-4o", "messages": m, "user": "bob"}) + "\n"
                           for m in (turn1, turn2, other)))
    out = tmp_path / "rows.json"
    assert main(["replay", str(log), "--model", tiny_gguf_path, "--page-rows", "4", "--json", str(out),
                 "--quiet"]) == 0
    [row] = json.loads(out.read_text())["rows"]
    tok = engine.load_model(tiny_gguf_path).tokenizer
    as_text = turn2[:-1] + [{"role": "user", "content": "And screws?"}]  # the parts, joined
    p1, p2, p3 = (tok.encode(tok.render_chat(m, add_generation_prompt=True)) for m in (turn1, as_text, other))
    assert p2[:len(p1)] == p1  # the template renders turn 2 as turn 1 and more
    shared_system = next(i for i, (a, b) in enumerate(zip(p1, p3)) if a != b)
    assert row["tokens_saved"] == len(p1) // 4 * 4 + shared_system // 4 * 4
    assert row["hits"] == 2 and row["requests"] == 3
