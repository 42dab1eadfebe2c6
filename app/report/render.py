"""Session reports as HTML and PDF (Qt, offscreen is fine), and `export_report` for every format.

The HTML is one self-contained file (inline CSS, charts and the page map as base64
PNG); prompts and answers are escaped text, never markup (Jinja2 autoescape). The
PDF is the same content laid out by QTextDocument on A4 pages through QPdfWriter.
JSON and CSV come from `app.report.files`, which needs no Qt.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jinja2

from engine.estimates import ttft_without_cache
from engine.metrics import PAGE_CACHED, PAGE_FREE, PAGE_PRIVATE, PAGE_SHARED
from engine.token_parts import PARTS
from ui.format import format_bytes  # the GUI's sizes: the same words on screen and on paper
from ui.format import secs as fmt_s  # and its durations

from ..advise.html import view_data
from .figures import Figure, chart_images, ensure_qt_app, page_map_image
from .files import (
    check_target,
    csv_paths,
    format_cell,
    write_bytes,
    write_csv,
    write_json,
)
from .model import Report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEMPLATE_DIR = os.path.join(ROOT, "resources", "report")

FORMATS = {".html": "html", ".htm": "html", ".pdf": "pdf", ".json": "json", ".csv": "csv", ".zip": "csv"}


def export_report(path: str | os.PathLike, report: Report) -> list[str]:
    """Write `report` in the format the extension names (.html/.htm, .pdf, .json, .csv, .zip).

    Returns the paths written (.csv writes `<stem>-requests.csv` and `<stem>-timeline.csv`).
    ValueError for another extension; ReportWriteError (an OSError) naming the path when
    the file cannot be written, with nothing half-written left behind.
    """
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    kind = FORMATS.get(ext)
    if kind is None:
        shown = ext or "(none)"
        raise ValueError(f"{path}: unknown report format {shown!r}; "
                         f"use .html, .htm, .pdf, .json, .csv or .zip")
    for target in csv_paths(path) if kind == "csv" else [path]:
        check_target(os.path.abspath(target))  # fail before drawing charts for a path that cannot work
    if kind == "json":
        return [write_json(path, report)]
    if kind == "csv":
        return write_csv(path, report)
    if kind == "html":
        return [write_html(path, report)]
    return [write_pdf(path, report)]


def write_html(path: str | os.PathLike, report: Report) -> str:
    """Write the self-contained HTML report atomically."""
    return write_bytes(path, render_html(report).encode("utf-8"))


def write_pdf(path: str | os.PathLike, report: Report) -> str:
    """Write the A4 PDF report atomically."""
    return write_bytes(path, render_pdf(report).data)


# --- HTML ---------------------------------------------------------------------------------


def fmt_pct(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:.1f} %"


def fmt_rate(x: float | None) -> str:
    return "–" if x is None else f"{x:.1f}"


def fmt_int(x: int | None) -> str:
    return "–" if x is None else f"{x:,}"


def fmt_drafts(accepted: int, drafted: int) -> str:
    """Speculative decoding's acceptance, e.g. "12 of 40 (30.0 %)"; "none drafted" without drafts."""
    return f"{accepted:,} of {drafted:,} ({fmt_pct(accepted / drafted)})" if drafted else "none drafted"


def fmt_any(x) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.4g}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


@dataclass
class Cell:
    """One table cell: its field name, exact value (data-value) and what a reader sees."""

    field: str
    value: str
    text: str
    numeric: bool = True


REQUEST_COLUMNS = [
    # field, header, formatter, tooltip
    ("id", "#", fmt_int, "request id"),
    ("preview", "Prompt", None, "the user prompt (first 60 characters)"),
    ("client", "Client", None, "an HTTP client's address, model and user fields (empty: typed in the app)"),
    ("n_prompt", "Prompt tok", fmt_int, "tokens in the whole prompt, system prompt included"),
    ("n_cached", "Cached", fmt_int, "prompt tokens attached from the cache (not computed)"),
    ("n_prefilled", "Prefilled", fmt_int, "prompt tokens computed by prefill"),
    ("n_gen", "Generated", fmt_int, "tokens generated"),
    ("queue_wait_s", "Queue wait", fmt_s, "time from submit to admission"),
    ("ttft_s", "TTFT", fmt_s, "time from arrival (submit) to the first token, queue wait included"),
    ("ttft_no_cache_s", "TTFT w/o cache (est.)", fmt_s,
     "a cache hit's estimated TTFT without the cache: its TTFT plus its cached tokens at this "
     "session's measured prefill rate"),
    ("decode_tps", "Tok/s", fmt_rate, "decode tokens per second of this request"),
    ("spec_acceptance", "Drafts acc.", fmt_pct,
     "speculative decoding: drafted tokens the model agreed with (–: none drafted)"),
    ("finish_reason", "Finish", None, "stop, length or cancelled"),
    ("chain_hit", "Hit chain", fmt_int, "the cached chain this prompt's prefix came from"),
    ("chain_donated", "Donated", fmt_int, "the chain this request's own pages went into"),
    ("parts", "Prompt tokens went", None,
     "where the prompt's tokens went (they add up to it): cached (of which from disk), lent, cap, "
     "evicted, isolated (another namespace's), rounding (a shared page not whole), new"),
    ("diverged_at", "Diverged at", fmt_int,
     "the token where the prompt departs from the longest earlier prompt sharing its start "
     "(its length: it never departs; –: none shares its first token)"),
]


def fmt_parts(parts) -> str | None:
    """A request's parts in words, the non-zero ones in prompt order ("cached 48 (disk 16) ·
    rounding 2 · new 10"); None for a report before version 3."""
    if parts is None:
        return None
    words = []
    for k in PARTS:
        n = getattr(parts, k)
        if n:
            words.append(f"{k} {n:,}" + (f" (disk {parts.disk:,})" if k == "cached" and parts.disk else ""))
    return " · ".join(words) or "none"

CHAIN_COLUMNS = [
    ("id", "Chain", fmt_int), ("preview", "Preview", None), ("n_tokens", "Tokens", fmt_int),
    ("pages_live", "Live pages", fmt_int), ("hits", "Hits", fmt_int),
    ("first_page_depth", "First page", fmt_int), ("namespace", "Namespace", None),
]


# A report's long tables show their first and last rows only: 100,000 requests took minutes and
# gigabytes as HTML; every row stays in the JSON and CSV exports.
TABLE_HEAD_ROWS = 200
TABLE_TAIL_ROWS = 50


def bounded_rows(items: list, make) -> list[dict]:
    """`make(item)` for the first and last rows, with one `{"gap": n}` row for the n left out
    between them (every row dict has a `gap`, 0 for a real row)."""
    n = len(items)
    if n <= TABLE_HEAD_ROWS + TABLE_TAIL_ROWS:
        return [{"gap": 0, **make(x)} for x in items]
    head = [{"gap": 0, **make(x)} for x in items[:TABLE_HEAD_ROWS]]
    tail = [{"gap": 0, **make(x)} for x in items[n - TABLE_TAIL_ROWS:]]
    return [*head, {"gap": n - TABLE_HEAD_ROWS - TABLE_TAIL_ROWS}, *tail]


def _cells(obj, columns, extra: dict | None = None) -> list[Cell]:
    """One Cell per column: the object's attribute, or `extra`'s value for derived columns."""
    out = []
    for col in columns:
        name, fmt = col[0], col[2]
        value = extra[name] if extra and name in extra else getattr(obj, name)
        numeric = fmt is not None
        text = fmt(value) if fmt else ("–" if value is None else str(value))
        out.append(Cell(name, format_cell(value), text, numeric))
    return out


def _ttft_no_cache(r, totals) -> float | None:
    """A hit's estimated TTFT without the cache (None for a miss or an unfinished request)."""
    if r.n_cached <= 0 or r.ttft_s is None:
        return None
    return ttft_without_cache(r.ttft_s, r.n_cached, totals.prefill_tok_s)


def _kv(pairs) -> list[tuple[str, str, str]]:
    """(label, shown text, exact value) rows of a key-value table."""
    return [(label, fmt_any(v) if not isinstance(v, str) else v, format_cell(v)) for label, v in pairs]


def _sampling_words(sp) -> str:
    """The sampling settings in one line: "greedy", or the parameters that matter."""
    words = "greedy" if sp.temperature <= 0 else (
        f"temperature {sp.temperature:g}, top-k {sp.top_k}, top-p {sp.top_p:g}, min-p {sp.min_p:g}")
    if sp.repeat_penalty != 1.0:
        words += f", repeat penalty {sp.repeat_penalty:g} over {sp.repeat_last_n}"
    if sp.seed is not None and sp.temperature > 0:
        words += f", seed {sp.seed}"
    return words


def _settings_rows(s) -> list[tuple[str, str, str]]:
    """The report's settings table: the scheduler's knobs and the sampling."""
    return _kv([
        ("page rows (positions per page)", s.page_rows),
        ("pool pages", s.pool_pages if s.pool_pages is not None else f"grows (now {s.pool_capacity})"),
        ("cache budget (pages)", s.cache_pages if s.cache_pages else "unbounded"),
        *([("KV budget", s.kv_budget)] if s.kv_budget else []),
        ("prefix cache", "on" if s.cache_enabled else "off"), ("max streams", s.max_streams),
        ("max queue", s.max_queue), ("chunk tokens", s.chunk_tokens),
        ("speculative decoding", "not recorded" if s.spec_enabled is None else
         f"on, k = {s.spec_k}" if s.spec_enabled else "off"),
        ("namespace", s.namespace or "(none)"), ("sampling", _sampling_words(s.sampling))])


def _context(report: Report, charts: list[Figure], page_map: Figure | None) -> dict:
    """What the HTML and PDF templates show, formatted, with exact values beside the text."""
    t, m, s = report.totals, report.model, report.settings
    cards = [
        ("hit_rate", "Hit rate", t.hit_rate, fmt_pct(t.hit_rate),
         f"{t.hits} of {t.queries} attaches hit"),
        ("prefill_saved", "Prefill tokens saved", t.prefill_saved, fmt_int(t.prefill_saved),
         f"{fmt_int(t.prefill_computed)} computed"),
        ("seconds_saved", "Seconds saved", t.seconds_saved, fmt_s(t.seconds_saved),
         f"at {t.prefill_tok_s:.1f} prefill tok/s"),
        ("requests", "Requests", t.requests, fmt_int(t.requests),
         f"{fmt_int(t.generated_tokens)} tokens generated"),
        ("decode_tok_s", "Decode tok/s", t.decode_tok_s, fmt_rate(t.decode_tok_s),
         f"{fmt_rate(t.mean_request_decode_tok_s)} per stream"),
    ]
    cards = [{"key": k, "label": label, "value": format_cell(v), "text": text, "sub": sub}
             for k, label, v, text, sub in cards]
    totals = [{"key": key, "label": label, "value": format_cell(getattr(t, key)),
               "text": fmt(getattr(t, key))}
              for key, label, fmt in (
        ("requests", "requests", fmt_int), ("finished", "finished", fmt_int),
        ("steps", "scheduler steps", fmt_int), ("wall_s", "wall time", fmt_s),
        ("queries", "cache queries (attaches)", fmt_int), ("hits", "cache hits", fmt_int),
        ("hit_pages", "hit pages", fmt_int), ("hit_rate", "hit rate", fmt_pct),
        ("prefill_computed", "prefill tokens computed", fmt_int),
        ("prefill_saved", "prefill tokens saved", fmt_int),
        ("prefill_tok_s", "prefill tok/s (measured)", fmt_rate), ("seconds_saved", "seconds saved", fmt_s),
        ("decode_tokens", "decode tokens", fmt_int), ("generated_tokens", "generated tokens", fmt_int),
        ("decode_tok_s", "decode tok/s (all streams)", fmt_rate),
        ("mean_request_decode_tok_s", "decode tok/s per stream (mean)", fmt_rate),
        ("peak_pages_in_use", "peak pages in use", fmt_int),
        ("peak_pages_sessions", "peak pages held by streams", fmt_int),
        ("spec_drafted", "draft tokens verified (speculative decoding)", fmt_int),
        ("spec_accepted", "drafts accepted", lambda n: fmt_drafts(n, t.spec_drafted)))]
    parts_rows = [{"key": k, "label": k + (" (of cached, loaded from the disk tier)" if k == "disk" else ""),
                   "value": format_cell(n), "text": fmt_int(n)} for k, n in (t.parts or {}).items()]
    model_rows = _kv([("file", m.file_name), ("name", m.name), ("architecture", m.architecture),
                      ("quantization", m.quantization), ("model", m.description),
                      ("parameters", m.parameters),
                      ("context length", m.context_length), ("layers", m.n_layers),
                      ("file size", format_bytes(m.file_size)), ("sha256", m.sha256)])
    settings_rows = _settings_rows(s)
    machine = report.machine
    machine_rows = _kv([("platform", machine.platform), ("CPUs", machine.cpu_count),
                        ("python", f"{machine.python} ({machine.python_implementation})")])
    version_rows = _kv([(k, v if v is not None else "not installed") for k, v in report.versions.items()])
    request_columns = REQUEST_COLUMNS
    if report.ttft_from != "arrival":  # a version 1 report: its TTFT starts at admission
        request_columns = [(f, "TTFT (from admission)" if f == "ttft_s" else head,
                            fmt, "time from admission to the first token" if f == "ttft_s" else tip)
                           for f, head, fmt, tip in REQUEST_COLUMNS]
    from ui.colors import LIGHT, STATE_LABELS, state_color  # the GUI's palette, light as on paper
    page_counts = [(STATE_LABELS[st], report.pages.count(st), state_color(st, LIGHT).name(), key)
                   for st, key in ((PAGE_PRIVATE, "private"), (PAGE_SHARED, "shared"),
                                   (PAGE_CACHED, "cached"), (PAGE_FREE, "free"))]
    return {
        "report": report, "cards": cards, "totals": totals, "fmt_any": fmt_any,
        "parts_rows": parts_rows, "model_rows": model_rows, "settings_rows": settings_rows,
        "machine_rows": machine_rows,
        "version_rows": version_rows, "request_columns": request_columns, **_tables(report),
        "ttft_note": (f"TTFT counts from {report.ttft_from}" + ("" if report.ttft_from == "arrival" else
                      " (a version 1 report)") + "; queue wait from submit to admission."),
        "chain_columns": CHAIN_COLUMNS, "charts": charts,
        "page_map": page_map, "page_counts": page_counts,
        "sha_short": m.sha256[:12],
        "advice": view_data(report.advice) if report.advice else None,  # docs/design.md §14
    }


def _tables(report: Report) -> dict:
    """The requests, chains and timeline tables, long ones summarised (`bounded_rows`)."""
    return {
        "requests": bounded_rows(report.requests, lambda r: {
            "id": r.id, "text": r.text, "hit": r.n_cached > 0,
            "cells": _cells(r, REQUEST_COLUMNS, {"ttft_no_cache_s": _ttft_no_cache(r, report.totals),
                                                 "parts": fmt_parts(r.parts)})}),
        "chains": bounded_rows(report.chains, lambda c: {"id": c.id, "cells": _cells(c, CHAIN_COLUMNS)}),
        "timeline_columns": list(report.timeline[0].to_dict()) if report.timeline else [],
        "timeline": bounded_rows(report.timeline, lambda r: {
            "cells": [Cell(k, format_cell(v), fmt_any(v)) for k, v in r.to_dict().items()]}),
        "timeline_steps": len(report.timeline),
    }


def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE_DIR), autoescape=True,
                              undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)


def render_html(report: Report, charts: list[Figure] | None = None, page_map: Figure | None = None) -> str:
    """The report as one self-contained HTML page (charts drawn now unless given)."""
    if charts is None:
        charts = chart_images(report)
    if page_map is None:
        page_map = page_map_image(report)
    return _env().get_template("report.html").render(**_context(report, charts, page_map))


# --- PDF ----------------------------------------------------------------------------------


@dataclass
class PdfResult:
    """A rendered PDF and how many pages it has."""

    data: bytes
    pages: int


PDF_DPI = 96          # 1 CSS pixel = 1 device pixel, as on screen
PDF_MARGIN_MM = 14
_FOOTER_PX = 22


def render_pdf(report: Report, charts: list[Figure] | None = None,
               page_map: Figure | None = None) -> PdfResult:
    """The report as an A4 PDF: QTextDocument laid out page by page onto a QPdfWriter."""
    ensure_qt_app()
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QMarginsF, QRectF, QSizeF, Qt, QUrl
    from PySide6.QtGui import (
        QColor,
        QFont,
        QImage,
        QPageLayout,
        QPageSize,
        QPainter,
        QPdfWriter,
        QTextDocument,
    )

    if charts is None:
        charts = chart_images(report)
    if page_map is None:
        page_map = page_map_image(report)
    markup = _env().get_template("report_pdf.html").render(**_context(report, charts, page_map))

    data = QByteArray()
    buf = QBuffer(data)
    buf.open(QIODevice.OpenModeFlag.WriteOnly)
    writer = QPdfWriter(buf)
    writer.setTitle(report.title)
    writer.setCreator("PrefixLab")
    writer.setResolution(PDF_DPI)
    writer.setPageLayout(QPageLayout(QPageSize(QPageSize.PageSizeId.A4), QPageLayout.Orientation.Portrait,
                                     QMarginsF(*[PDF_MARGIN_MM] * 4), QPageLayout.Unit.Millimeter))
    body = writer.pageLayout().paintRectPixels(writer.resolution())
    page_w, page_h = body.width(), body.height() - _FOOTER_PX

    doc = QTextDocument()
    doc.documentLayout().setPaintDevice(writer)
    font = QFont("DejaVu Sans")
    font.setStyleHint(QFont.StyleHint.SansSerif)
    font.setPointSizeF(8.5)
    doc.setDefaultFont(font)
    doc.setDocumentMargin(0)
    for fig in [*charts, *([page_map] if page_map else [])]:
        doc.addResource(QTextDocument.ResourceType.ImageResource, QUrl(f"{fig.key}.png"),
                        QImage.fromData(fig.png, "PNG"))
    doc.setHtml(markup)
    doc.setPageSize(QSizeF(page_w, page_h))
    n_pages = doc.pageCount()

    painter = QPainter(writer)
    footer_font = QFont(font)
    footer_font.setPointSizeF(7.5)
    for i in range(n_pages):
        if i:
            writer.newPage()
        painter.save()
        painter.translate(0, -i * page_h)
        page = QRectF(0, i * page_h, page_w, page_h)
        painter.setClipRect(page)  # the next page's first line must not show above this footer
        doc.drawContents(painter, page)
        painter.restore()
        painter.setFont(footer_font)
        painter.setPen(QColor("#59636e"))
        foot = QRectF(0, page_h + 4, page_w, _FOOTER_PX - 4)
        painter.drawText(foot, int(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter),
                         _elide(report.title, 90))
        painter.drawText(foot, int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter),
                         f"page {i + 1} of {n_pages}")
    painter.end()
    buf.close()
    return PdfResult(bytes(data), n_pages)


def _elide(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


__all__ = ["FORMATS", "PdfResult", "export_report", "render_html", "render_pdf", "write_html", "write_pdf"]
