"""Reports from strangers: every field's range checked on load, and a huge report exports bounded."""

# ruff: noqa: E402  (Qt must see QT_QPA_PLATFORM before anything imports it)
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import dataclasses
import json

import msgspec
import pytest

from app.report import build_report, load_report, report_to_dict
from app.report.render import TABLE_HEAD_ROWS, TABLE_TAIL_ROWS, export_report
from engine.loop import EngineLoop

pytestmark = pytest.mark.model
N_BIG = 100_000


def small_report(model):
    """The report of a real two-request run."""
    system = "You answer for a hardware store. Be brief."
    loop = EngineLoop(model)
    sch = loop.scheduler
    for q in ("What is a torx screw?", "Do you sell rakes?"):
        loop.submit_now(system=system, user=q, max_new_tokens=4)
    loop.run_until_done()
    return build_report(sch, model, system, None)


@pytest.fixture(scope="module")
def report(real_model):
    return small_report(real_model)


def broken(report, tmp_path, change) -> str:
    data = json.loads(json.dumps(report_to_dict(report)))
    change(data)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data), "utf-8")
    with pytest.raises(ValueError) as e:
        load_report(path)
    assert str(path) in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("change, words", [
    (lambda d: d["pages"]["states"].__setitem__(0, 7), ["pages.states[0]", "0-3", "7"]),
    (lambda d: d["pages"]["states"].__setitem__(1, -1), ["pages.states[1]", "-1"]),
    (lambda d: d["pages"]["refcounts"].__setitem__(0, -2), ["pages.refcounts[0]", ">= 0"]),
    (lambda d: d["totals"].__setitem__("requests", -5), ["totals.requests", ">= 0", "-5"]),
    (lambda d: d["requests"][1].__setitem__("n_gen", -1), ["requests[1].n_gen"]),
    (lambda d: d["totals"].__setitem__("hit_rate", 3.5), ["totals.hit_rate", "at most 1"]),
    (lambda d: d["timeline"][0].__setitem__("capacity", -64), ["timeline[0].capacity"]),
    (lambda d: d["pages"].__setitem__("capacity", 10**9), ["pages.capacity"]),
    (lambda d: d["settings"].__setitem__("page_rows", "16"), ["settings.page_rows"]),
    # a lone surrogate escape (found by the report fuzz target): text no UTF-8 file can hold
    (lambda d: d["model"].__setitem__("name", "x\ud800y"), ["model.name", "unpaired surrogate"]),
    (lambda d: d["requests"][0].__setitem__("text", "\udfff"), ["requests[0].text", "surrogate"]),
])
def test_an_out_of_range_report_is_refused_naming_the_field(report, tmp_path, change, words):
    message = broken(report, tmp_path, change)
    assert all(w in message for w in words), message


def test_non_finite_numbers_and_deep_nesting_are_refused(report, tmp_path):
    text = json.dumps(report_to_dict(report)).replace('"wall_s": ', '"wall_s": NaN, "x": ', 1)
    path = tmp_path / "nan.json"
    path.write_text(text, "utf-8")
    with pytest.raises(ValueError, match="finite"):
        load_report(path)
    path.write_text("[" * 100_000 + "]" * 100_000, "utf-8")
    with pytest.raises(ValueError, match="nested too deeply"):
        load_report(path)


def test_a_100000_request_report_exports_with_its_long_tables_summarised(report, tmp_path):
    r0, row = report.requests[0], report.timeline[-1]
    big = msgspec.structs.replace(
        report, requests=[dataclasses.replace(r0, id=i + 1, preview=f"prompt {i + 1}") for i in range(N_BIG)],
        timeline=[dataclasses.replace(row, step=i + 1) for i in range(N_BIG)])
    html = export_report(tmp_path / "big.html", big)[0]
    text = open(html, encoding="utf-8").read()
    left_out = N_BIG - TABLE_HEAD_ROWS - TABLE_TAIL_ROWS
    assert f"{left_out} requests left out" in text and f"{left_out} steps left out" in text
    assert "prompt 1<" in text and f"prompt {N_BIG}<" in text and f"prompt {N_BIG // 2}<" not in text
    assert len(text) < 5_000_000
    pdf = export_report(tmp_path / "big.pdf", big)[0]
    assert open(pdf, "rb").read(5) == b"%PDF-"
    exported = export_report(tmp_path / "big.json", big)[0]
    assert len(load_report(exported).requests) == N_BIG  # the JSON keeps every row
