"""Where every prompt token went in `prefixlab run`'s totals and in its reports (JSON, CSV,
HTML), the same numbers as the scheduler's records (docs/design.md §15)."""

from __future__ import annotations

import re

from app.cli import main
from app.report import load_report
from app.report.files import read_csv
from engine.token_parts import KEYS, PARTS

SYSTEM = "You are a helpful assistant at a hardware store. Answer in one short sentence."


def test_run_prints_the_totals_by_part_and_the_reports_carry_them(tiny_gguf_path, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["run", "--model", tiny_gguf_path, "--system", SYSTEM, "--page-rows", "4",
                 "--prompt", "Do you sell hammers?", "--prompt", "Do you sell nails?",
                 "--prompt", "Do you sell hammers?", "--max-new", "6", "--max-streams", "1",
                 "--json", f"{out}.json", "--report", f"{out}.csv"]) == 0
    printed = capsys.readouterr().out
    line = re.search(r"prompt tokens ([\d,]+): cached ([\d,]+) \(disk ([\d,]+)\), (.*)", printed)
    assert line, printed
    said = {"cached": line[2], "disk": line[3],
            **dict(w.split(" ") for w in line[4].split(", "))}
    said = {k: int(v.replace(",", "")) for k, v in said.items()}

    report = load_report(f"{out}.json")
    assert report.schema == "prefixlab.report/3"
    assert report.totals.parts == said
    assert sum(said[p] for p in PARTS) == int(line[1].replace(",", "")) == sum(
        r.n_prompt for r in report.requests)
    first, second, third = report.requests
    assert first.parts.new == first.n_prompt and first.diverged_at is None
    assert second.parts.cached > 0 and second.diverged_from == first.id
    assert second.parts.rounding == second.diverged_at - second.parts.cached
    for r in report.requests:
        assert r.parts.total == r.n_prompt and r.parts.cached == r.n_cached

    rows = read_csv(open(f"{out}-requests.csv", encoding="utf-8").read())
    assert [int(rows[i][f"tokens_{k}"]) for i in range(3) for k in KEYS] == [
        getattr(r.parts, k) for r in report.requests for k in KEYS]
    assert rows[1]["diverged_at"] == str(second.diverged_at)


def test_the_html_view_shows_each_requests_parts(tiny_gguf_path, tmp_path):
    html = tmp_path / "r.html"
    assert main(["run", "--model", tiny_gguf_path, "--system", SYSTEM, "--page-rows", "4", "--quiet",
                 "--prompt", "Do you sell hammers?", "--prompt", "Do you sell nails?", "--max-new", "3",
                 "--max-streams", "1", "--report", str(html)]) == 0
    text = html.read_text(encoding="utf-8")
    assert "Prompt tokens went" in text and "Diverged at" in text
    assert re.search(r"cached [\d,]+ · rounding \d+ · new [\d,]+", text), "the second request's parts"
    assert "Where the prompt tokens went" in text and 'data-part="rounding"' in text
