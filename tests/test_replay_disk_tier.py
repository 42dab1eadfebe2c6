"""`prefixlab replay --disk-budget`: the same page and cache code with a second tier under the budget."""

from __future__ import annotations

import json

from app.cli import main
from app.replay.results import ReplayConfig
from app.replay.simulate import replay
from app.replay.trace import open_trace


def hash_trace(tmp_path) -> str:
    """Mooncake's form: three 6-block prefixes taking turns, each request with its own last block."""
    lines = []
    for i in range(30):
        prefix = [1000 * (i % 3) + b for b in range(6)]
        lines.append(json.dumps({"timestamp": i * 100, "input_length": 6 * 512 + 10, "output_length": 4,
                                 "hash_ids": prefix + [100_000 + i]}))
    path = tmp_path / "mooncake.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_disk_tier_turns_evictions_into_hits(tmp_path):
    src = open_trace(hash_trace(tmp_path), block_size=512)
    one = replay(src, ReplayConfig(budget=8))                 # one prefix fits, three take turns
    two = replay(src, ReplayConfig(budget=8, disk_budget=24))
    inf = replay(src, ReplayConfig())
    assert one.blocks_from_disk == 0 and two.blocks_from_disk > 0
    assert one.token_hit_ratio < two.token_hit_ratio <= inf.token_hit_ratio
    assert two.disk_budget == 24 and two.to_json()["blocks_from_disk"] == two.blocks_from_disk


def test_cli_two_tier_rows(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["replay", hash_trace(tmp_path), "--block-size", "512", "--budget", "8",
                 "--disk-budget", "8,24", "--json", str(out), "--workers", "1", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "disk" in text.splitlines()[0]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["budget"], r["disk_budget"]) for r in rows] == [(8, 8), (8, 24)]
    assert rows[0]["token_hit_ratio"] < rows[1]["token_hit_ratio"]
