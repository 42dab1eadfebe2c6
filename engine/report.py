"""A session report: one data model built from the scheduler, written as JSON or CSV (no Qt here).

`build_report` copies everything a report shows out of a `Scheduler`; `write_json`
and `write_csv` write it atomically; `load_report` reads a JSON report back and
validates it. The JSON schema is `prefixlab.report/1`, documented field by field
in docs/report-schema.md. HTML and PDF rendering need Qt and live in
`app/report_render.py`.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import os
import platform
import tempfile
import types
import typing
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from importlib import metadata

import numpy as np

from .loader import Model
from .metrics import PAGE_STATE_NAMES, RequestRecord, TimelineRow
from .prefix_cache import ChainRecord, prefix_chain_list
from .sampler import SamplingParams
from .snapshot import PageInfo, Snapshot

SCHEMA_NAME = "prefixlab.report"
SCHEMA_VERSION = 1
SCHEMA = f"{SCHEMA_NAME}/{SCHEMA_VERSION}"

# Distributions whose versions a report records (PySide6 under either wheel name).
_VERSIONED = ("numpy", "gguf", "tokenizers", "jinja2", "pyqtgraph")

_SHA_CHUNK = 1 << 20
_sha_cache: dict[tuple[str, int, int], str] = {}


class ReportWriteError(OSError):
    """A report could not be written; the message names the path and the reason."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"cannot write report {path}: {reason}")
        self.path = path
        self.reason = reason

    def __str__(self) -> str:
        return self.args[0]


# --- the data model --------------------------------------------------------------------


@dataclass
class ModelInfo:
    """The model the session ran."""

    file_name: str
    sha256: str
    file_size: int
    name: str
    architecture: str
    quantization: str
    parameters: int
    context_length: int
    n_layers: int
    vocab_size: int


@dataclass
class ReportSettings:
    """The scheduler's settings and the sampling the requests used."""

    page_rows: int
    pool_pages: int | None  # the configured bound; None: the pool grows
    pool_capacity: int      # pages the pool had at the end
    cache_pages: int        # the cache's page budget; 0: unbounded
    cache_enabled: bool
    max_streams: int
    max_queue: int
    chunk_tokens: int
    namespace: str
    sampling: SamplingParams


@dataclass
class Totals:
    """Session totals, in the words of DESIGN §5."""

    requests: int
    finished: int
    steps: int
    wall_s: float
    queries: int
    hits: int
    hit_pages: int
    hit_rate: float             # prefill_saved / (prefill_saved + prefill_computed)
    prefill_computed: int
    prefill_saved: int
    prefill_tok_s: float        # measured prefill rate of this session
    seconds_saved: float        # prefill_saved / prefill_tok_s
    decode_tokens: int          # tokens made by batched decode passes
    generated_tokens: int       # sum of n_gen over requests
    decode_tok_s: float         # decode_tokens / (step time not spent on prefill)
    mean_request_decode_tok_s: float
    peak_pages_in_use: int      # max over steps of pages with a reference (sessions or cache)
    peak_pages_sessions: int    # max over steps of pages a session holds


@dataclass
class PageMapState:
    """Every pool page at the end of the session."""

    page_rows: int
    capacity: int
    state_names: dict[str, str]      # state code (as a string) -> name
    states: list[int]                # per page: 0 free, 1 private, 2 shared, 3 cached
    refcounts: list[int]             # per page
    chain_ids: list[int | None]      # per page: the owning chain for cached pages

    def count(self, state: int) -> int:
        return sum(1 for s in self.states if s == state)


@dataclass
class MachineInfo:
    """Where the session ran."""

    platform: str
    machine: str
    processor: str
    cpu_count: int | None
    python: str
    python_implementation: str


@dataclass
class Report:
    """Everything one session report holds; JSON, CSV, HTML and PDF are views of it."""

    title: str
    created_at: str
    model: ModelInfo
    settings: ReportSettings
    system_prompt: str
    totals: Totals
    requests: list[RequestRecord]
    timeline: list[TimelineRow]
    chains: list[ChainRecord]
    pages: PageMapState
    machine: MachineInfo
    versions: dict[str, str | None]
    schema: str = SCHEMA


# --- building ---------------------------------------------------------------------------


def file_sha256(path: str) -> str:
    """SHA-256 of a file, read in 1 MiB chunks; remembered per (path, size, mtime)."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    digest = _sha_cache.get(key)
    if digest is None:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            while chunk := fh.read(_SHA_CHUNK):
                h.update(chunk)
        digest = _sha_cache[key] = h.hexdigest()
    return digest


def model_info(model: Model) -> ModelInfo:
    """Name, hash and shape of a loaded model."""
    cfg = model.config
    try:
        sha = file_sha256(model.path)
    except OSError:
        sha = ""  # the file went away after loading; the report still says which model ran
    return ModelInfo(file_name=os.path.basename(model.path), sha256=sha, file_size=int(model.file_size),
                     name=model.name, architecture=model.arch, quantization=model.quant,
                     parameters=int(model.n_params), context_length=int(cfg.context_length),
                     n_layers=int(cfg.n_layers), vocab_size=int(cfg.vocab_size))


def machine_info() -> MachineInfo:
    return MachineInfo(platform=platform.platform(), machine=platform.machine(),
                       processor=platform.processor(), cpu_count=os.cpu_count(),
                       python=platform.python_version(),
                       python_implementation=platform.python_implementation())


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _prefixlab_version() -> str | None:
    v = _dist_version("prefixlab")
    if v is not None:
        return v
    # A source checkout that is not installed: read the version from pyproject.toml.
    pyproject = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
    try:
        import tomllib
        with open(pyproject, "rb") as fh:
            return str(tomllib.load(fh)["project"]["version"])
    except (OSError, KeyError, ValueError):
        return None


def versions() -> dict[str, str | None]:
    """Versions of PrefixLab and the libraries it runs on (None: not installed); no imports of Qt."""
    out = {"prefixlab": _prefixlab_version()}
    out.update({name: _dist_version(name) for name in _VERSIONED})
    out["PySide6"] = _dist_version("PySide6-Essentials", "PySide6")
    return out


def _totals(scheduler, records: list[RequestRecord], rows: list[TimelineRow]) -> Totals:
    c = scheduler.cache.counters
    computed, saved = scheduler.prefill_computed, scheduler.prefill_saved
    step_seconds = sum(r.step_s for r in rows)
    decode_seconds = max(0.0, step_seconds - scheduler.prefill_seconds)
    rates = [r.decode_tps for r in records if r.decode_tps is not None]
    if rows:
        peak_used = max(r.pages_private + r.pages_shared + r.pages_cached for r in rows)
        peak_sessions = max(r.pages_private + r.pages_shared for r in rows)
    else:
        peak_used = peak_sessions = int(scheduler.pool.num_used_pages)
    return Totals(
        requests=len(records), finished=sum(1 for r in records if r.finish_reason is not None),
        steps=len(rows), wall_s=rows[-1].wall_s if rows else 0.0,
        queries=int(c.queries), hits=int(c.hits), hit_pages=int(c.hit_pages),
        hit_rate=saved / (saved + computed) if saved + computed else 0.0,
        prefill_computed=int(computed), prefill_saved=int(saved),
        prefill_tok_s=float(scheduler.prefill_rate()), seconds_saved=float(scheduler.seconds_saved()),
        decode_tokens=int(scheduler.decode_tokens), generated_tokens=sum(r.n_gen for r in records),
        decode_tok_s=scheduler.decode_tokens / decode_seconds if decode_seconds > 0 else 0.0,
        mean_request_decode_tok_s=sum(rates) / len(rates) if rates else 0.0,
        peak_pages_in_use=int(peak_used), peak_pages_sessions=int(peak_sessions))


def _page_map(scheduler) -> PageMapState:
    states = scheduler.page_states()
    pool, cache = scheduler.pool, scheduler.cache
    chain_ids: list[int | None] = [None] * len(states)
    for page, key in cache.by_page.items():
        chain_ids[page] = int(cache.pages[key].chain_id)
    return PageMapState(page_rows=int(pool.page_rows), capacity=int(pool.capacity),
                        state_names={str(k): v for k, v in PAGE_STATE_NAMES.items()},
                        states=[int(s) for s in states], refcounts=[int(n) for n in pool.refcount],
                        chain_ids=chain_ids)


def build_report(scheduler, model: Model, system_prompt: str, sampling: SamplingParams | None,
                 title: str = "", *, namespace: str | None = None) -> Report:
    """Copy everything a report shows out of a scheduler (call it between steps, on its thread)."""
    s = scheduler.settings
    records = [dataclasses.replace(r) for r in scheduler.records.values()]
    rows = [dataclasses.replace(r) for r in scheduler.timeline.rows]
    if namespace is None:
        names = sorted({r.namespace for r in records})
        namespace = names[0] if len(names) == 1 else ""
    settings = ReportSettings(
        page_rows=s.page_rows, pool_pages=s.pool_pages, pool_capacity=int(scheduler.pool.capacity),
        cache_pages=s.cache_pages, cache_enabled=s.cache_enabled, max_streams=s.max_streams,
        max_queue=s.max_queue, chunk_tokens=s.chunk_tokens, namespace=namespace,
        sampling=dataclasses.replace(sampling) if sampling is not None else SamplingParams())
    return Report(
        title=title or f"PrefixLab session report: {model.name}",
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        model=model_info(model), settings=settings, system_prompt=system_prompt,
        totals=_totals(scheduler, records, rows), requests=records, timeline=rows,
        chains=[dataclasses.replace(c) for c in prefix_chain_list(scheduler.cache)],
        pages=_page_map(scheduler), machine=machine_info(), versions=versions())


def snapshot_from_report(report: Report) -> Snapshot:
    """An engine Snapshot of the report's end state, so the GUI's panels can show a loaded report."""
    p = report.pages
    states = np.array(p.states, dtype=np.int8)
    pages = {i: PageInfo(i, p.refcounts[i], p.states[i], p.chain_ids[i], first_position=None)
             for i in range(len(p.states)) if p.chain_ids[i] is not None}
    return Snapshot(timeline=list(report.timeline), page_states=states,
                    refcounts=np.array(p.refcounts, dtype=np.int64), pages=pages,
                    chains=[dataclasses.replace(c) for c in report.chains],
                    records=[dataclasses.replace(r) for r in report.requests], page_rows=p.page_rows,
                    prefill_tok_s=report.totals.prefill_tok_s, seconds_saved=report.totals.seconds_saved)


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


Writer = Callable[[typing.BinaryIO], None]


def atomic_write_many(targets: list[tuple[str | os.PathLike, Writer]]) -> list[str]:
    """Write each (path, write(fh)) into a temporary file beside its path, then rename them all.

    Nothing is renamed until every file is written, so a failure leaves the old files as they
    were and no temporary file behind. Any OSError becomes a ReportWriteError naming the path.
    """
    paths = [os.path.abspath(os.fspath(p)) for p, _ in targets]
    for path in paths:
        check_target(path)
    temps: list[str] = []
    path = paths[0]
    try:
        for path, (_, write) in zip(paths, targets, strict=True):
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{os.path.basename(path)}.",
                                       suffix=".tmp")
            temps.append(tmp)
            with os.fdopen(fd, "wb") as fh:
                write(fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o644)
        for path, tmp in zip(paths, temps, strict=True):
            os.replace(tmp, path)
        temps = []
    except OSError as e:
        raise ReportWriteError(path, e.strerror or str(e)) from e
    finally:
        for tmp in temps:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return paths


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
    d = asdict(report)
    d["timeline"] = [r.to_dict() for r in report.timeline]
    schema = d.pop("schema")
    return {"schema": schema, **d}


def report_to_json(report: Report) -> str:
    return json.dumps(report_to_dict(report), indent=1, ensure_ascii=False, allow_nan=False) + "\n"


def write_json(path: str | os.PathLike, report: Report) -> str:
    """Write the report as `prefixlab.report/1` JSON (UTF-8), atomically."""
    try:
        text = report_to_json(report)
    except ValueError as e:  # NaN or infinity somewhere: JSON cannot carry them
        raise ReportWriteError(os.fspath(path), f"the report holds a value JSON cannot store ({e})") from e
    return write_bytes(path, text.encode("utf-8"))


class _Bad(ValueError):
    """A validation failure at a field path; load_report adds the file name."""


_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
               type(None): "null"}


def _type_name(tp) -> str:
    return _TYPE_WORDS.get(tp) or getattr(tp, "__name__", None) or str(tp)


def _convert(tp, value, where: str):
    """Check `value` (from JSON) against the annotation `tp` and build it."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, where)
            except _Bad:
                continue
        raise _Bad(f"field '{where}': expected {' or '.join(_type_name(a) for a in args)}, "
                   f"got {_json_type(value)}")
    if origin is list:
        if not isinstance(value, list):
            raise _Bad(f"field '{where}': expected a list, got {_json_type(value)}")
        (item,) = typing.get_args(tp)
        return [_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _Bad(f"field '{where}': expected an object, got {_json_type(value)}")
        _, item = typing.get_args(tp)
        return {str(k): _convert(item, v, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _dataclass_from(tp, value, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise _Bad(f"field '{where}': expected true or false, got {_json_type(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Bad(f"field '{where}': expected an integer, got {_json_type(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _Bad(f"field '{where}': expected a number, got {_json_type(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _Bad(f"field '{where}': expected a string, got {_json_type(value)}")
        return value
    raise TypeError(f"report field '{where}' has an unsupported annotation {tp!r}")


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    return "a list" if isinstance(value, list) else "an object"


def _dataclass_from(cls, value, where: str):
    if not isinstance(value, dict):
        raise _Bad(f"field '{where or '(top level)'}': expected an object, got {_json_type(value)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        sub = f"{where}.{f.name}" if where else f.name
        if f.name not in value:
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            if has_default:
                continue
            raise _Bad(f"field '{sub}' is missing")
        kwargs[f.name] = _convert(hints[f.name], value[f.name], sub)
    # Unknown keys are ignored (derived values such as a timeline row's hit_rate, and
    # fields that a later 1.x writer adds), so additive changes keep schema version 1.
    return cls(**kwargs)


def parse_schema(schema, where: str = "schema") -> int:
    """The version of a `prefixlab.report/N` schema string; ValueError otherwise."""
    if not isinstance(schema, str) or "/" not in schema:
        raise _Bad(f"field '{where}': expected \"{SCHEMA}\", got {_json_type(schema)}")
    name, _, version = schema.rpartition("/")
    if name != SCHEMA_NAME:
        raise _Bad(f"field '{where}': not a PrefixLab report (schema {schema!r}, expected {SCHEMA!r})")
    if not version.isdigit():
        raise _Bad(f"field '{where}': bad schema version in {schema!r}")
    if int(version) != SCHEMA_VERSION:
        raise _Bad(f"field '{where}': schema version {version} is not supported "
                   f"(this PrefixLab reads version {SCHEMA_VERSION})")
    return int(version)


def report_from_dict(data) -> Report:
    """Validate a decoded JSON report and build it; ValueError names the field."""
    if not isinstance(data, dict):
        raise _Bad(f"expected a JSON object at the top level, got {_json_type(data)}")
    if "schema" not in data:
        raise _Bad(f"field 'schema' is missing (expected \"{SCHEMA}\")")
    parse_schema(data["schema"])
    report = _dataclass_from(Report, data, "")
    states = report.pages.states
    for name, values in (("refcounts", report.pages.refcounts), ("chain_ids", report.pages.chain_ids)):
        if len(values) != len(states):
            raise _Bad(f"field 'pages.{name}': has {len(values)} entries but pages.states has {len(states)}")
    return report


def load_report(path: str | os.PathLike) -> Report:
    """Read a JSON report; ValueError names the file and the field that is wrong."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as e:
        raise ValueError(f"{path}: cannot read report ({e.strerror or e})") from e
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from e
    try:
        return report_from_dict(data)
    except _Bad as e:
        raise ValueError(f"{path}: {e}") from None


# --- CSV ---------------------------------------------------------------------------------

REQUEST_COLUMNS = [f.name for f in dataclasses.fields(RequestRecord)]


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
    """One row per request, the columns of RequestRecord."""
    return _csv_text(REQUEST_COLUMNS, [r.to_dict() for r in report.requests])


def timeline_csv(report: Report) -> str:
    """One row per scheduler step, the columns of TimelineRow plus hit_rate."""
    return _csv_text(TimelineRow.columns(), [r.to_dict() for r in report.timeline])


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


__all__ = [
    "SCHEMA", "MachineInfo", "ModelInfo", "PageMapState", "Report", "ReportSettings", "ReportWriteError",
    "Totals", "atomic_write", "atomic_write_many", "build_report", "check_target", "csv_paths",
    "file_sha256", "load_report", "read_csv", "report_from_dict", "report_to_dict", "report_to_json",
    "requests_csv", "snapshot_from_report", "timeline_csv", "versions", "write_bytes", "write_csv",
    "write_json",
]

