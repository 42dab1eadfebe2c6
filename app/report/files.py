"""Reports on disk: atomic writes, JSON (`prefixlab.report/3`) and CSV (no Qt here).

`write_json` and `write_csv` write a `Report` atomically; `load_report` reads a JSON
report back (version 2, or version 1 with its TTFT counted from admission) and validates
it with a typed msgspec decode.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import re
import zipfile

import msgspec

from engine import atomic
from engine.atomic import Writer
from engine.metrics import RequestRecord, TimelineRow
from engine.token_parts import KEYS

from .model import READABLE_VERSIONS, SCHEMA, SCHEMA_NAME, Report


class ReportWriteError(OSError):
    """A report could not be written; the message names the path and the reason."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"cannot write report {path}: {reason}")
        self.path = path
        self.reason = reason

    def __str__(self) -> str:
        return self.args[0]


# --- atomic writes -----------------------------------------------------------------------


def check_target(path: str) -> None:
    """ReportWriteError now if `path` cannot be a file (no folder, or a folder itself)."""
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise ReportWriteError(path, "it is a folder")
    if not os.path.exists(folder):
        raise ReportWriteError(path, f"the folder {folder} does not exist")
    if not os.path.isdir(folder):
        raise ReportWriteError(path, f"{folder} is not a folder")




def atomic_write_many(targets: list[tuple[str | os.PathLike, Writer]]) -> list[str]:
    """Write each (path, write(fh)) atomically (engine/atomic.py), all renamed only once all are written.

    Any OSError becomes a ReportWriteError naming the path; no temporary file is left behind.
    """
    paths = [os.path.abspath(os.fspath(p)) for p, _ in targets]
    for path in paths:
        check_target(path)
    try:
        return atomic.atomic_write_many([(path, w) for path, (_, w) in zip(paths, targets, strict=True)])
    except atomic.WriteFailed as e:
        raise ReportWriteError(e.path, e.reason) from e


def atomic_write(path: str | os.PathLike, write: Writer) -> str:
    """Write through `write(fh)` into a temporary file beside `path`, then rename it over `path`.

    Any OSError becomes a ReportWriteError naming the path; no temporary file is left behind.
    """
    return atomic_write_many([(path, write)])[0]


def write_bytes(path: str | os.PathLike, data: bytes) -> str:
    """Write `data` to `path` atomically."""
    return atomic_write(path, _bytes_writer(data))


# --- JSON --------------------------------------------------------------------------------


def report_to_dict(report: Report) -> dict:
    """The JSON object of a report: `schema` first, timeline rows with their hit_rate."""
    d = msgspec.to_builtins(report)  # (dataclasses.asdict row by row took 23 s for 100,000 rows)
    d["timeline"] = _timeline_dicts(report, d["timeline"])
    schema = d.pop("schema")
    return {"schema": schema, **d}


def _timeline_dicts(report: Report, rows: list[dict] | None = None) -> list[dict]:
    """The timeline rows as dicts with their hit_rate (TimelineRow.to_dict's columns)."""
    rows = msgspec.to_builtins(report.timeline) if rows is None else rows
    for row, r in zip(rows, report.timeline, strict=True):
        row["hit_rate"] = r.hit_rate
    return rows


def report_to_json(report: Report) -> str:
    """Indented JSON; ValueError for NaN or infinity. Encoded by C (json's indenting encoder is
    pure Python: 45 s for 100,000 requests), then indented by msgspec."""
    compact = json.dumps(report_to_dict(report), ensure_ascii=False, allow_nan=False)
    return msgspec.json.format(compact, indent=1) + "\n"


def write_json(path: str | os.PathLike, report: Report) -> str:
    """Write the report as `prefixlab.report/3` JSON (UTF-8), atomically."""
    try:
        text = report_to_json(report)
    except ValueError as e:  # NaN or infinity somewhere: JSON cannot carry them
        raise ReportWriteError(os.fspath(path), f"the report holds a value JSON cannot store ({e})") from e
    return write_bytes(path, text.encode("utf-8"))


class _Bad(ValueError):
    """A validation failure at a field path; load_report adds the file name."""


# msgspec's words: "Expected `int`, got `str` - at `$.requests[1].n_prompt`",
# "Object missing required field `hit_rate` - at `$.totals`".
_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$\.?(?P<where>[^`]*)`)?$", re.DOTALL)
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]+)`$")


def _field_error(e: msgspec.ValidationError) -> str:
    """msgspec's validation message, said with the field's path first."""
    m = _AT.match(str(e))
    what, where = m.group("what"), m.group("where") or ""
    missing = _MISSING.match(what)
    if missing:
        name = f"{where}.{missing.group('name')}" if where else missing.group("name")
        return f"field '{name}' is missing"
    what = what[0].lower() + what[1:] if what else what
    return f"field '{where or '(top level)'}': {what}"


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    return type(value).__name__


def parse_schema(schema, where: str = "schema") -> int:
    """The version of a readable `prefixlab.report/N` schema string; ValueError otherwise."""
    if not isinstance(schema, str) or "/" not in schema:
        raise _Bad(f"field '{where}': expected \"{SCHEMA}\", got {_json_type(schema)}")
    name, _, version = schema.rpartition("/")
    if name != SCHEMA_NAME:
        raise _Bad(f"field '{where}': not a PrefixLab report (schema {schema!r}, expected {SCHEMA!r})")
    if not version.isdigit():
        raise _Bad(f"field '{where}': bad schema version in {schema!r}")
    if int(version) not in READABLE_VERSIONS:
        raise _Bad(f"field '{where}': schema version {version} is not supported "
                   f"(this PrefixLab reads versions {', '.join(map(str, READABLE_VERSIONS))})")
    return int(version)


def report_from_dict(data) -> Report:
    """Validate a decoded JSON object as a report and build it; ValueError names the field.
    Unknown keys are ignored (derived values such as a timeline row's hit_rate, and fields a
    later 2.x writer adds)."""
    if not isinstance(data, dict):
        got = "a list" if isinstance(data, list) else _json_type(data)
        raise _Bad(f"expected a JSON object at the top level, got {got}")
    if "schema" not in data:
        raise _Bad(f"field 'schema' is missing (expected \"{SCHEMA}\")")
    parse_schema(data["schema"])
    try:
        report = msgspec.convert(data, Report)
    except msgspec.ValidationError as e:
        raise _Bad(_field_error(e)) from None
    states = report.pages.states
    for name, values in (("refcounts", report.pages.refcounts), ("chain_ids", report.pages.chain_ids)):
        if len(values) != len(states):
            raise _Bad(f"field 'pages.{name}': has {len(values)} entries but pages.states has {len(states)}")
    _check_ranges(report)
    return report


PAGE_STATE_CODES = range(4)  # free, private, shared, cached
# numbers a report may hold below zero: a seed, and times relative to the scheduler's start
_SIGNED = ("sampling.seed", "submitted_s", "finished_s", "created_at", "last_hit_at")
_FRACTIONS = ("hit_rate", "spec_acceptance", "top_p", "min_p")


def _check_ranges(report: Report) -> None:
    """Every number finite and >= 0 (fractions at most 1), page states 0-3: what the views and
    charts index by; a type-valid report can still hold -5 pages or state 9."""
    bad = next((i for i, s in enumerate(report.pages.states) if s not in PAGE_STATE_CODES), None)
    if bad is not None:
        raise _Bad(f"field 'pages.states[{bad}]': a page state is 0-3 (free, private, shared, cached), "
                   f"got {report.pages.states[bad]}")
    if report.pages.capacity != len(report.pages.states):
        raise _Bad(f"field 'pages.capacity': {report.pages.capacity}, but pages.states has "
                   f"{len(report.pages.states)} pages")
    _check_numbers(msgspec.to_builtins(report), "")


_INF = float("inf")


def _check_numbers(value, where: str) -> None:
    if isinstance(value, dict):
        # A number in [0, 1] is fine at any path, as is one in (1, inf) whose key names no
        # fraction (no suffix in _FRACTIONS holds a dot); strings and None hold no number: only
        # containers and the rest get a path built (a 100,000-request report has 6 million).
        for key, item in value.items():
            if isinstance(item, (dict, list)) or (
                    isinstance(item, (int, float)) and not isinstance(item, bool)
                    and not (0 <= item <= 1 or (1 < item < _INF and not str(key).endswith(_FRACTIONS)))):
                _check_numbers(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        # An item's path ends in "]": neither signed nor a fraction, so a number is fine when
        # 0 <= x < inf (False for NaN too); only containers and bad numbers get a path built.
        for i, item in enumerate(value):
            if isinstance(item, (dict, list)) or (
                    isinstance(item, (int, float)) and not isinstance(item, bool) and not 0 <= item < _INF):
                _check_numbers(item, f"{where}[{i}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and not where.endswith(_SIGNED):
        if value != value or value in (float("inf"), float("-inf")):
            raise _Bad(f"field '{where}': must be a finite number, got {value}")
        if value < 0:
            raise _Bad(f"field '{where}': must be >= 0, got {value}")
        if where.endswith(_FRACTIONS) and value > 1:
            raise _Bad(f"field '{where}': a fraction must be at most 1, got {value}")


def report_from_json(raw: bytes) -> Report:
    """Parse and validate a JSON report; ValueError says what is wrong."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise _Bad("not a report: JSON nested too deeply") from None
    except UnicodeDecodeError as e:
        raise _Bad(f"not UTF-8 text (byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise _Bad(f"not valid JSON (line {e.lineno}: {e.msg})") from e
    # Valid UTF-8 holds no surrogate: only a \ud800-\udfff escape decodes to one, so the walk
    # runs only when the raw text has such an escape (or looks like one: a false alarm is a walk)
    where = _surrogate_field(data) if _SURROGATE_ESCAPE.search(raw) else None
    if where is not None:  # JSON's \ud800 escapes decode to text no UTF-8 file or widget can hold
        raise _Bad(f"field '{where}': text holds an unpaired surrogate (\\ud800-\\udfff)")
    return report_from_dict(data)


_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _surrogate_field(value, where: str = "") -> str | None:
    """The dotted path of the first key or string holding an unpaired surrogate, or None."""
    stack = [(value, where)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return at or "(top level)"
        elif isinstance(v, dict):
            for k, item in v.items():
                path = f"{at}.{k}" if at else str(k)
                if _SURROGATE.search(k):
                    return path
                stack.append((item, path))
        elif isinstance(v, list):
            stack.extend((item, f"{at}[{i}]") for i, item in enumerate(v))
    return None


def load_report(path: str | os.PathLike) -> Report:
    """Read a JSON report; ValueError names the file and the field that is wrong."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as e:
        raise ValueError(f"{path}: cannot read report ({e.strerror or e})") from e
    try:
        return report_from_json(raw)
    except _Bad as e:
        raise ValueError(f"{path}: {e}") from None


# --- CSV ---------------------------------------------------------------------------------

# A request's scalar fields, its parts one column each (`tokens_cached`, ...) in place of the
# `parts` object, `evicted_by` in words; the tenant's own view stays in the JSON.
_NESTED = ("parts", "evicted_by", "tenant")
REQUEST_COLUMNS = [c for f in dataclasses.fields(RequestRecord) if f.name != "tenant"
                   for c in ([f"tokens_{k}" for k in KEYS] if f.name == "parts" else [f.name])]


def format_cell(value) -> str:
    """A value as CSV or HTML data: empty for None, repr for floats (they round-trip exactly)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _csv_text(columns: list[str], rows: list[dict]) -> str:
    buf = io.StringIO(newline="")
    w = csv.writer(buf, lineterminator="\r\n")
    w.writerow(columns)
    for row in rows:
        w.writerow([format_cell(row[c]) for c in columns])
    return buf.getvalue()


def requests_csv(report: Report) -> str:
    """One row per request, the columns of RequestRecord (its parts flattened)."""
    rows = []
    for r, d in zip(report.requests, msgspec.to_builtins(report.requests), strict=True):
        for name in _NESTED:
            d.pop(name, None)
        d.update({f"tokens_{k}": getattr(r.parts, k) if r.parts else None for k in KEYS})
        d["evicted_by"] = r.evicted_by.describe() if r.evicted_by else None
        rows.append(d)
    return _csv_text(REQUEST_COLUMNS, rows)


def timeline_csv(report: Report) -> str:
    """One row per scheduler step, the columns of TimelineRow plus hit_rate."""
    return _csv_text(TimelineRow.columns(), _timeline_dicts(report))


def csv_paths(path: str | os.PathLike) -> list[str]:
    """Where `write_csv` writes: the .zip itself, or `<stem>-requests.csv` and `<stem>-timeline.csv`."""
    path = os.fspath(path)
    stem, ext = os.path.splitext(path)
    if ext.lower() == ".zip":
        return [path]
    return [f"{stem}-requests.csv", f"{stem}-timeline.csv"]


def write_csv(path: str | os.PathLike, report: Report) -> list[str]:
    """CSV of requests and timeline: a .zip holding both, or for .csv two files beside it."""
    path = os.fspath(path)
    texts = {"requests.csv": requests_csv(report), "timeline.csv": timeline_csv(report)}
    if os.path.splitext(path)[1].lower() == ".zip":
        def write_zip(fh):
            with zipfile.ZipFile(fh, "w", compression=zipfile.ZIP_DEFLATED) as z:
                for name, text in texts.items():
                    z.writestr(name, text.encode("utf-8"))
        return [atomic_write(path, write_zip)]
    return atomic_write_many([(target, _bytes_writer(text.encode("utf-8")))
                              for target, text in zip(csv_paths(path), texts.values(), strict=True)])


def _bytes_writer(data: bytes) -> Writer:
    return lambda fh: fh.write(data)


def read_csv(text: str) -> list[dict[str, str]]:
    """Rows of a report CSV as dicts of strings (empty string: None)."""
    return list(csv.DictReader(io.StringIO(text, newline="")))
