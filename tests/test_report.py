"""Session reports: one real 4-prompt run on the bundled model, exported as JSON, CSV, HTML and PDF."""
# ruff: noqa: E402  (Qt must see QT_QPA_PLATFORM before anything imports it)

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import base64
import csv
import hashlib
import io
import json
import re
import shutil
import stat
import subprocess
import sys
import zipfile
from html.parser import HTMLParser

import msgspec
import pytest

import engine
from app.desktop.settings import AppSettings
from app.report import (
    SCHEMA,
    Report,
    ReportWriteError,
    atomic_write,
    build_report,
    load_report,
    report_to_dict,
    snapshot_from_report,
)
from app.report.render import export_report, render_html, render_pdf
from engine.loop import EngineLoop
from engine.sampler import SamplingParams
from engine.token_parts import KEYS, Eviction

pytestmark = pytest.mark.model

SYSTEM = ("You are Bolt, the assistant of Harbor Hardware, a store for tools, paint, screws, garden "
          "supplies and plumbing parts. The store opens at 8am and closes at 6pm every day. Answer in one "
          "short sentence and say so when you do not know.")
EVIL = "<script>alert(1)</script> Is this safe?"
QUESTIONS = ["What is a torx screw?", "Which paint is best for a bathroom?", EVIL, "Do you sell rakes?"]
TITLE = "Report test <b>bold</b> & more"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(real_model):
    """A real run: 4 prompts sharing a ~60-token system prompt, 8 new tokens each."""
    model = real_model
    assert 50 <= len(engine.encode(model, SYSTEM)) <= 75
    loop = EngineLoop(model)
    sch = loop.scheduler
    sampling = SamplingParams()
    for q in QUESTIONS:
        loop.submit_now(system=SYSTEM, user=q, sampling=sampling, max_new_tokens=8)
    loop.run_until_done()
    return sch, model, build_report(sch, model, SYSTEM, sampling, title=TITLE)


@pytest.fixture(scope="module")
def report(run) -> Report:
    return run[2]


@pytest.fixture(scope="module")
def exported(report, tmp_path_factory) -> dict:
    """The report in every format, and the PDF's page count as laid out."""
    out = tmp_path_factory.mktemp("report")
    paths = {}
    for name in ("report.json", "report.html", "report.pdf", "report.zip", "report.csv"):
        paths[name] = export_report(out / name, report)
    return {"dir": out, "paths": paths, "json": json.loads((out / "report.json").read_text("utf-8")),
            "pdf_pages": render_pdf(report).pages}


class Parsed(HTMLParser):
    """Tags (with attributes) and the text inside elements carrying data-field or data-metric."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.field_text: dict[tuple[str, str], str] = {}
        self._row: str | None = None
        self._field: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "tr":
            self._row = a.get("data-request-id") or a.get("data-answer-for")
        if tag == "td" and "data-field" in a:
            self._field = a["data-field"]

    def handle_endtag(self, tag):
        if tag == "td":
            self._field = None

    def handle_data(self, data):
        self.text.append(data)
        if self._field and self._row:
            key = (self._row, self._field)
            self.field_text[key] = self.field_text.get(key, "") + data


def parse_html(path) -> Parsed:
    p = Parsed()
    p.feed(path.read_text("utf-8"))
    p.close()
    return p


def same(cell: str, value) -> bool:
    """A machine-readable cell (HTML data-value or CSV) equals a JSON value exactly."""
    if value is None:
        return cell == ""
    if isinstance(value, bool):
        return cell == ("true" if value else "false")
    if isinstance(value, float):
        return float(cell) == value
    if isinstance(value, int):
        return int(cell) == value
    return cell == value


# --- the data model ---------------------------------------------------------------------------


def test_report_holds_the_run(run):
    sch, model, rep = run
    assert rep.schema == SCHEMA == "prefixlab.report/3" and rep.ttft_from == "arrival"
    assert len(rep.requests) == 4 and all(r.finish_reason for r in rep.requests)
    assert [r.preview for r in rep.requests] == QUESTIONS
    assert all(r.text for r in rep.requests)
    t = rep.totals
    assert t.prefill_saved == sum(r.n_cached for r in rep.requests) > 0
    assert t.prefill_computed == sum(r.n_prefilled for r in rep.requests)
    assert t.hit_rate == pytest.approx(t.prefill_saved / (t.prefill_saved + t.prefill_computed))
    assert t.seconds_saved == sch.seconds_saved() > 0
    assert t.generated_tokens == sum(r.n_gen for r in rep.requests)
    assert t.decode_tok_s > 0 and t.peak_pages_in_use >= t.peak_pages_sessions > 0
    assert t.steps == len(rep.timeline) == len(sch.timeline)
    assert rep.timeline[-1] == sch.timeline.rows[-1]
    assert [c.id for c in rep.chains] == [c.id for c in engine.prefix_chain_list(sch.cache)]
    assert rep.pages.states == sch.page_states().tolist() and len(rep.pages.states) == rep.pages.capacity
    with open(model.path, "rb") as fh:
        assert rep.model.sha256 == hashlib.sha256(fh.read()).hexdigest()
    assert (rep.model.architecture, rep.model.quantization) == ("llama", "Q4_1")
    assert rep.model.context_length == model.config.context_length and rep.model.parameters > 1e8
    assert rep.settings.page_rows == 16 and rep.settings.cache_enabled
    assert rep.settings.sampling == SamplingParams()
    assert rep.settings.spec_enabled is False and rep.totals.spec_drafted == rep.totals.spec_accepted == 0
    assert rep.system_prompt == SYSTEM and rep.title == TITLE
    assert rep.versions["numpy"] and rep.versions["prefixlab"] and rep.machine.python
    snap = snapshot_from_report(rep)  # what File -> Open report feeds the GUI's panels
    assert snap.page_states.tolist() == rep.pages.states and snap.timeline == rep.timeline
    assert {p for p, info in snap.pages.items() if info.chain_id is not None} == set(sch.cache.by_page)


def test_report_files_import_no_qt():
    code = ("import sys, app.report; "
            "sys.exit(any(m.startswith(('PySide6', 'pyqtgraph')) for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


# --- JSON -------------------------------------------------------------------------------------


def test_json_round_trips(exported, report):
    path = exported["dir"] / "report.json"
    data = exported["json"]
    assert next(iter(data)) == "schema" and data["schema"] == SCHEMA
    assert data == report_to_dict(report)
    loaded = load_report(path)
    assert loaded == report
    assert msgspec.to_builtins(loaded) == msgspec.to_builtins(report)


def _bad(tmp_path, data, name="bad.json"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data), "utf-8")
    with pytest.raises(ValueError) as e:
        load_report(p)
    assert str(p) in str(e.value)
    return str(e.value)


def test_load_report_rejects_bad_input(exported, tmp_path):
    good = exported["json"]
    assert "not valid JSON" in _bad(tmp_path, "{not json")
    assert "top level" in _bad(tmp_path, [1, 2])
    assert "'schema' is missing" in _bad(tmp_path, {k: v for k, v in good.items() if k != "schema"})
    assert "not a PrefixLab report" in _bad(tmp_path, {**good, "schema": "other.report/1"})
    assert "version 4 is not supported" in _bad(tmp_path, {**good, "schema": "prefixlab.report/4"})
    bad = json.loads(json.dumps(good))
    bad["requests"][1]["n_prompt"] = "many"
    msg = _bad(tmp_path, bad)
    assert "requests[1].n_prompt" in msg and "`int`" in msg and "`str`" in msg
    bad = json.loads(json.dumps(good))
    bad["settings"]["cache_enabled"] = 1
    assert "settings.cache_enabled" in _bad(tmp_path, bad)
    bad = json.loads(json.dumps(good))
    del bad["totals"]["hit_rate"]
    assert "'totals.hit_rate' is missing" in _bad(tmp_path, bad)
    bad = json.loads(json.dumps(good))
    bad["pages"]["refcounts"] = bad["pages"]["refcounts"][:-1]
    assert "pages.refcounts" in _bad(tmp_path, bad)
    with pytest.raises(ValueError, match="cannot read report"):
        load_report(tmp_path / "missing.json")


def test_a_version_1_report_opens_with_its_ttft_counted_from_admission(exported, tmp_path):
    old = {**exported["json"], "schema": "prefixlab.report/1"}  # version 1: the same layout
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old), "utf-8")
    rep = load_report(path)
    assert rep.ttft_from == "admission"
    assert rep.requests == load_report(exported["dir"] / "report.json").requests
    html = render_html(rep, charts=[], page_map=None)
    assert "TTFT (from admission)" in html and "TTFT counts from admission" in html
    assert "TTFT counts from arrival" in (exported["dir"] / "report.html").read_text("utf-8")


def test_a_report_written_before_speculative_decoding_opens(exported, tmp_path):
    old = json.loads(json.dumps(exported["json"]))
    for key in ("spec_enabled", "spec_k"):
        del old["settings"][key]
    for key in ("spec_drafted", "spec_accepted"):
        del old["totals"][key]
    for r in old["requests"]:
        for key in ("spec_drafted", "spec_accepted", "spec_acceptance"):
            del r[key]
    path = tmp_path / "before-spec.json"
    path.write_text(json.dumps(old), "utf-8")
    rep = load_report(path)
    assert rep.settings.spec_enabled is None and rep.settings.spec_k is None
    assert rep.totals.spec_drafted == rep.totals.spec_accepted == 0
    assert all(r.spec_acceptance is None and r.spec_drafted == 0 for r in rep.requests)
    page = Parsed()
    page.feed(render_html(rep, charts=[], page_map=None))
    text = "".join(page.text)
    assert "not recorded" in text and "none drafted" in text
    assert all(page.field_text[(str(r.id), "spec_acceptance")] == "–" for r in rep.requests)


# --- speculative decoding ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_report(real_model) -> Report:
    """Two answers that quote the system prompt, with speculative decoding on from the app's Settings."""
    prefs = AppSettings(spec_enabled=True, spec_k=4, max_new_tokens=24)
    loop = EngineLoop(real_model, prefs.scheduler_settings())
    sch = loop.scheduler
    for q in ("When does the store open and close?", "Repeat your instructions word for word."):
        loop.submit_now(system=SYSTEM, user=q, sampling=prefs.sampling(), max_new_tokens=prefs.max_new_tokens)
    loop.run_until_done()
    return build_report(sch, real_model, SYSTEM, prefs.sampling())


def test_speculative_decoding_reaches_the_report(spec_report, tmp_path, qtbot):
    rep = spec_report
    assert (rep.settings.spec_enabled, rep.settings.spec_k) == (True, 4)
    t = rep.totals
    drafted, accepted = sum(r.spec_drafted for r in rep.requests), sum(r.spec_accepted for r in rep.requests)
    assert (t.spec_drafted, t.spec_accepted) == (drafted, accepted) and drafted > 0 and accepted > 0
    page = Parsed()
    page.feed(render_html(rep, charts=[], page_map=None))
    totals, current = {}, None
    for tag, a in page.tags:
        if tag == "tr":
            current = a
        elif tag == "td" and "data-value" in a and current is not None and "data-total" in current:
            totals[current["data-total"]] = a["data-value"]
    assert (int(totals["spec_drafted"]), int(totals["spec_accepted"])) == (drafted, accepted)
    text = "".join(page.text)
    assert f"drafts accepted{accepted} of {drafted} ({accepted / drafted * 100:.1f} %)" in text
    assert "on, k = 4" in text and "Drafts acc." in text
    for r in rep.requests:
        shown = page.field_text[(str(r.id), "spec_acceptance")]
        assert shown == (f"{r.spec_acceptance * 100:.1f} %" if r.spec_drafted else "–")
    # The PDF lays out the same totals and column.
    from app.report.render import _context, _env
    markup = _env().get_template("report_pdf.html").render(**_context(rep, [], None))
    assert f"{accepted} of {drafted} (" in markup and "Drafts<br>acc." in markup
    # The window's Requests tab shows the same acceptance as the report's column.
    from ui.requests_table import COLUMNS, RequestsTable
    table = RequestsTable()
    qtbot.addWidget(table)
    for r in rep.requests:
        table.add_record(r)
    col = COLUMNS.index("Drafts acc.")
    for row, r in enumerate(rep.requests):  # the window's dash for "none" is the em dash of its other columns
        shown = page.field_text[(str(r.id), "spec_acceptance")]
        assert table.item(row, col).text() == shown.replace("–", "—")
    # And the JSON carries it all back.
    [json_path] = export_report(tmp_path / "spec.json", rep)
    assert load_report(json_path) == rep


# --- HTML -------------------------------------------------------------------------------------


def test_html_numbers_equal_the_json(exported):
    data = exported["json"]
    page = parse_html(exported["dir"] / "report.html")
    cards = {a["data-metric"]: a["data-value"] for t, a in page.tags if "data-metric" in a}
    assert set(cards) == {"hit_rate", "prefill_saved", "seconds_saved", "requests", "decode_tok_s"}
    for key, cell in cards.items():
        assert same(cell, data["totals"][key]), key
    totals = {}
    rows = {}
    chains = {}
    steps = []
    parts = {}
    current = None
    for tag, a in page.tags:
        if tag == "tr":
            current = a
            if "data-step" in a:
                steps.append({})
        elif tag == "td" and "data-value" in a and current is not None:
            if "data-total" in current:
                totals[current["data-total"]] = a["data-value"]
            elif "data-request-id" in current:
                rows.setdefault(int(current["data-request-id"]), {})[a["data-field"]] = a["data-value"]
            elif "data-chain-id" in current:
                chains.setdefault(int(current["data-chain-id"]), {})[a["data-field"]] = a["data-value"]
            elif "data-step" in current:
                steps[-1][a["data-field"]] = a["data-value"]
            elif "data-part" in current:
                parts[current["data-part"]] = a["data-value"]
    # the totals by part have a table of their own (docs/design.md §15)
    assert {k: int(v) for k, v in parts.items()} == data["totals"]["parts"]
    assert set(totals) | {"parts"} == set(data["totals"])
    for key, cell in totals.items():
        assert same(cell, data["totals"][key]), key
    assert sorted(rows) == [r["id"] for r in data["requests"]]
    numeric = ["n_prompt", "n_cached", "n_prefilled", "n_gen", "queue_wait_s", "ttft_s", "decode_tps",
               "spec_acceptance", "finish_reason", "chain_hit", "chain_donated"]
    for r in data["requests"]:
        for key in numeric:
            assert same(rows[r["id"]][key], r[key]), (r["id"], key)
        assert page.field_text[(str(r["id"]), "preview")] == r["preview"]
        assert page.field_text[(str(r["id"]), "text")] == r["text"]
        # A hit's TTFT without the cache: its TTFT + its cached tokens at the measured prefill rate.
        est = rows[r["id"]]["ttft_no_cache_s"]
        if r["n_cached"] > 0:
            assert same(est, r["ttft_s"] + r["n_cached"] / data["totals"]["prefill_tok_s"]), r["id"]
        else:
            assert est == "", est
    assert any(r["n_cached"] > 0 for r in data["requests"])
    assert sorted(chains) == [c["id"] for c in data["chains"]]
    for c in data["chains"]:
        for key in ("n_tokens", "pages_live", "hits", "first_page_depth"):
            assert same(chains[c["id"]][key], c[key])
    assert len(steps) == len(data["timeline"])
    for cells, row in zip(steps, data["timeline"], strict=True):
        assert cells.keys() == row.keys()
        assert all(same(cells[k], row[k]) for k in row)
    counts = {a["data-pages"]: int(a["data-value"]) for t, a in page.tags if "data-pages" in a}
    states = data["pages"]["states"]
    assert counts == {"free": states.count(0), "private": states.count(1), "shared": states.count(2),
                      "cached": states.count(3)}


def test_html_shows_prompts_as_text_only(exported):
    raw = (exported["dir"] / "report.html").read_text("utf-8")
    page = parse_html(exported["dir"] / "report.html")
    assert "script" not in [t for t, _ in page.tags]
    assert "&lt;b&gt;bold&lt;/b&gt; &amp; more" in raw
    assert EVIL in "".join(page.text)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in raw
    assert TITLE in "".join(page.text)
    values = [v for _, a in page.tags for v in a.values() if v]
    assert not any(v.lstrip().lower().startswith("javascript:") for v in values)


def test_html_is_self_contained_with_charts(exported):
    page = parse_html(exported["dir"] / "report.html")
    for tag, a in page.tags:
        for attr in ("src", "href"):
            if attr in a:
                assert a[attr].startswith("data:image/png;base64,"), (tag, a[attr][:40])
    figures = [a["data-chart"] for t, a in page.tags if t == "figure"]
    assert len(figures) >= 4 and "page_map" in figures
    images = [a["src"] for t, a in page.tags if t == "img"]
    assert len(images) == len(figures)
    for src in images:
        png = base64.b64decode(src.split(",", 1)[1])
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 2000


# --- CSV --------------------------------------------------------------------------------------


def _rows(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text, newline="")))


def _as_csv_row(r: dict) -> dict:
    """A JSON request as requests.csv writes it: its parts one column each, `evicted_by` in words,
    the tenant's view left out (docs/report-schema.md)."""
    out = {}
    for key, value in r.items():
        if key == "parts":
            out.update({f"tokens_{k}": value[k] if value else None for k in KEYS})
        elif key == "evicted_by":
            out[key] = Eviction(**value).describe() if value else None
        elif key != "tenant":
            out[key] = value
    return out


def test_csv_equals_the_json(exported):
    data = exported["json"]
    with zipfile.ZipFile(exported["dir"] / "report.zip") as z:
        assert sorted(z.namelist()) == ["requests.csv", "timeline.csv"]
        req_text, tl_text = z.read("requests.csv").decode(), z.read("timeline.csv").decode()
    assert exported["paths"]["report.csv"] == [str(exported["dir"] / "report-requests.csv"),
                                               str(exported["dir"] / "report-timeline.csv")]
    assert not (exported["dir"] / "report.csv").exists()
    assert (exported["dir"] / "report-requests.csv").read_bytes().decode() == req_text
    assert (exported["dir"] / "report-timeline.csv").read_bytes().decode() == tl_text
    requests = _rows(req_text)
    assert len(requests) == len(data["requests"])
    for cells, r in zip(requests, data["requests"], strict=True):
        r = _as_csv_row(r)
        assert cells.keys() == r.keys()
        for key, value in r.items():
            assert same(cells[key], value) if not isinstance(value, str) else cells[key] == value, key
    timeline = _rows(tl_text)
    assert len(timeline) == len(data["timeline"])
    for cells, row in zip(timeline, data["timeline"], strict=True):
        assert cells.keys() == row.keys() and all(same(cells[k], row[k]) for k in row)


# --- PDF --------------------------------------------------------------------------------------


def _pdf_title(pdf: bytes) -> str:
    m = re.search(rb"/Title \((.*?)\)\n", pdf, re.S)
    raw = re.sub(rb"\\(.)", rb"\1", m.group(1))
    return raw[2:].decode("utf-16-be") if raw.startswith(b"\xfe\xff") else raw.decode("latin-1")


def test_pdf_pages_title_and_images(exported, report):
    pdf = (exported["dir"] / "report.pdf").read_bytes()
    assert pdf.startswith(b"%PDF-") and pdf.rstrip().endswith(b"%%EOF")
    pages = len(re.findall(rb"/Type\s*/Page(?![a-zA-Z])", pdf))
    assert pages == exported["pdf_pages"] >= 3  # summary + requests, charts, page map and tables
    assert re.search(rb"/MediaBox \[0 0 595(\.0+)? 842(\.0+)?\]", pdf)  # A4 in points
    assert _pdf_title(pdf) == TITLE
    assert len(re.findall(rb"/Subtype /Image", pdf)) >= 5  # the charts and the page map
    if shutil.which("pdftotext"):  # poppler, when installed: the title is on page 1
        first = subprocess.run(["pdftotext", "-f", "1", "-l", "1", "-layout",
                                str(exported["dir"] / "report.pdf"), "-"], capture_output=True, text=True)
        assert TITLE in first.stdout and "Requests" in first.stdout


# --- errors -----------------------------------------------------------------------------------


def _unwritable_dir(tmp_path):
    """A folder no report can be written into: read-only, or (as root) a path under a regular file."""
    ro = tmp_path / "readonly"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    probe = ro / "probe"
    try:
        probe.write_bytes(b"")
    except OSError:
        return ro, ro
    probe.unlink()  # root ignores the mode bits: a regular file as the "folder" fails for anyone
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    return blocker, tmp_path


@pytest.mark.parametrize("name", ["r.json", "r.html", "r.pdf", "r.zip", "r.csv"])
def test_unwritable_path_fails_clearly_and_leaves_nothing(report, tmp_path, name):
    folder, watch = _unwritable_dir(tmp_path)
    before = sorted(os.listdir(watch))
    target = folder / name
    with pytest.raises(ReportWriteError) as e:
        export_report(target, report)
    # The message names the file (for .csv, the <stem>-requests.csv it would have written).
    assert os.path.splitext(str(target))[0] in str(e.value) and isinstance(e.value, OSError)
    assert sorted(os.listdir(watch)) == before
    if folder.is_dir():
        folder.chmod(0o755)


def test_failed_write_keeps_the_old_file(tmp_path):
    target = tmp_path / "keep.json"
    target.write_text("old")

    def boom(fh):
        fh.write(b"half a rep")
        raise OSError(28, "No space left on device")

    with pytest.raises(ReportWriteError, match="No space left"):
        atomic_write(target, boom)
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["keep.json"]
    with pytest.raises(ReportWriteError, match="does not exist"):
        atomic_write(tmp_path / "nope" / "x.json", boom)


def test_unknown_extension_is_refused(report, tmp_path):
    with pytest.raises(ValueError, match=r"'\.txt'"):
        export_report(tmp_path / "report.txt", report)
    with pytest.raises(ValueError, match="none"):
        export_report(tmp_path / "report", report)
    assert os.listdir(tmp_path) == []


def test_html_without_charts_says_so(report):
    from app.report.figures import page_map_image
    page_map = page_map_image(report)
    assert page_map.png.startswith(b"\x89PNG")
    page = Parsed()
    page.feed(render_html(report, charts=[], page_map=page_map))
    assert "No charts" in "".join(page.text) and "script" not in [t for t, _ in page.tags]
    assert [a["data-chart"] for t, a in page.tags if t == "figure"] == ["page_map"]
