"""A session report's data model and `build_report`, which copies it out of a scheduler (no Qt here).

The model is msgspec Structs (around the engine's record dataclasses), so reading a JSON
report back is a typed decode. The JSON schema is `prefixlab.report/3`, documented field by
field in docs/report-schema.md; `app.report.files` writes and reads it (and CSV),
`app.report.render` draws HTML and PDF with Qt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from datetime import UTC, datetime

import msgspec
import numpy as np

from engine.api import prefix_chain_list
from engine.loader import Model
from engine.metrics import PAGE_STATE_NAMES, RequestRecord, TimelineRow
from engine.prefix_records import ChainRecord
from engine.sampler import SamplingParams
from engine.snapshot import PageInfo, Snapshot
from engine.token_parts import add_parts, zero_totals

from ..model_info import model_info as describe_model
from ..system_info import machine, versions

SCHEMA_NAME = "prefixlab.report"
SCHEMA_VERSION = 3
SCHEMA = f"{SCHEMA_NAME}/{SCHEMA_VERSION}"
# Versions this PrefixLab reads. Version 1 is version 2's layout with TTFT counted from
# admission (the scheduler started the request), not from arrival (submit); version 3 adds
# where every prompt token went (docs/design.md §15), absent (null) in older reports.
READABLE_VERSIONS = (1, 2, 3)
TTFT_FROM = {1: "admission", 2: "arrival", 3: "arrival"}

_SHA_CHUNK = 1 << 20
_sha_cache: dict[tuple[str, int, int], str] = {}


# --- the data model --------------------------------------------------------------------


class ModelInfo(msgspec.Struct, kw_only=True):
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
    description: str = ""   # architecture, tokenizer type and quantization mix (Model.describe)


class ReportSettings(msgspec.Struct, kw_only=True):
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
    # Speculative decoding; None: a report written before these were recorded.
    spec_enabled: bool | None = None
    spec_k: int | None = None   # tokens drafted per stream and step, at most
    # The KV budget's line ("KV budget 2.35 GiB (10% of RAM): 3,190 pages"); "": not recorded.
    kv_budget: str = ""


class Totals(msgspec.Struct, kw_only=True):
    """Session totals, in the words of docs/design.md §6."""

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
    spec_drafted: int = 0       # speculative draft tokens verified (sum over requests; 0 in older reports)
    spec_accepted: int = 0      # of those, the ones the sampler agreed with
    # The requests' prompt tokens by part (docs/design.md §15); None in reports before version 3.
    parts: dict[str, int] | None = None


class PageMapState(msgspec.Struct, kw_only=True):
    """Every pool page at the end of the session."""

    page_rows: int
    capacity: int
    state_names: dict[str, str]      # state code (as a string) -> name
    states: list[int]                # per page: 0 free, 1 private, 2 shared, 3 cached
    refcounts: list[int]             # per page
    chain_ids: list[int | None]      # per page: the owning chain for cached pages

    def count(self, state: int) -> int:
        return sum(1 for s in self.states if s == state)


class MachineInfo(msgspec.Struct, kw_only=True):
    """Where the session ran."""

    platform: str
    machine: str
    processor: str
    cpu_count: int | None
    python: str
    python_implementation: str


class Report(msgspec.Struct, kw_only=True):
    """Everything one session report holds; JSON, CSV, HTML and PDF are views of it."""

    schema: str = SCHEMA
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
    advice: dict | None = None  # `prefixlab.advice/2` (/1 still reads): the Advisor tab's, if it had traffic

    @property
    def version(self) -> int:
        """The schema version this report was written in."""
        return int(self.schema.rpartition("/")[2])

    @property
    def ttft_from(self) -> str:
        """What its TTFT figures count from: "arrival" (submit), or "admission" in version 1 reports."""
        return TTFT_FROM[self.version]


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
    """Name, hash and shape of a loaded model (the GUI's model description, plus the file's hash)."""
    d = describe_model(model)
    try:
        sha = file_sha256(model.path)
    except OSError:
        sha = ""  # the file went away after loading; the report still says which model ran
    return ModelInfo(file_name=d["file"], sha256=sha, file_size=d["file_size"], name=d["name"],
                     architecture=d["arch"], quantization=d["quant"], parameters=d["n_params"],
                     context_length=d["context_length"], n_layers=d["n_layers"], vocab_size=d["vocab_size"],
                     description=d["description"])


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
    parts = zero_totals()
    for r in records:
        if r.parts is not None:
            add_parts(parts, r.parts)
    return Totals(
        requests=len(records), finished=sum(1 for r in records if r.finish_reason is not None),
        steps=len(rows), wall_s=rows[-1].wall_s if rows else 0.0,
        queries=int(c.queries), hits=int(c.hits), hit_pages=int(c.hit_pages),
        hit_rate=rows[-1].hit_rate if rows else 0.0,  # the rows count cumulatively
        prefill_computed=int(computed), prefill_saved=int(saved),
        prefill_tok_s=float(scheduler.prefill_rate()), seconds_saved=float(scheduler.seconds_saved()),
        decode_tokens=int(scheduler.decode_tokens), generated_tokens=sum(r.n_gen for r in records),
        decode_tok_s=scheduler.decode_tokens / decode_seconds if decode_seconds > 0 else 0.0,
        mean_request_decode_tok_s=sum(rates) / len(rates) if rates else 0.0,
        peak_pages_in_use=int(peak_used), peak_pages_sessions=int(peak_sessions),
        spec_drafted=sum(r.spec_drafted for r in records),
        spec_accepted=sum(r.spec_accepted for r in records), parts=parts)


def _page_map(scheduler) -> PageMapState:
    states = scheduler.page_states()
    pool, cache = scheduler.pool, scheduler.cache
    chain_ids: list[int | None] = [None] * len(states)
    for page in cache.held_pages():
        chain_ids[page] = cache.chain_of(page)
    return PageMapState(page_rows=int(pool.page_rows), capacity=int(pool.capacity),
                        state_names={str(k): v for k, v in PAGE_STATE_NAMES.items()},
                        states=[int(s) for s in states], refcounts=[int(n) for n in pool.refcount],
                        chain_ids=chain_ids)


def build_report(scheduler, model: Model, system_prompt: str, sampling: SamplingParams | None,
                 title: str = "", *, namespace: str | None = None, kv_budget: str = "") -> Report:
    """Copy everything a report shows out of a scheduler (call it between steps, on its thread)."""
    s = scheduler.settings
    records = [dataclasses.replace(r) for r in scheduler.records()]
    rows = [dataclasses.replace(r) for r in scheduler.timeline.rows]
    if namespace is None:
        names = sorted({r.namespace for r in records})
        namespace = names[0] if len(names) == 1 else ""
    settings = ReportSettings(
        page_rows=s.page_rows, pool_pages=s.pool_pages, pool_capacity=int(scheduler.pool.capacity),
        cache_pages=s.cache_pages, cache_enabled=s.cache_enabled, max_streams=s.max_streams,
        max_queue=s.max_queue, chunk_tokens=s.chunk_tokens, namespace=namespace,
        sampling=dataclasses.replace(sampling) if sampling is not None else SamplingParams(),
        spec_enabled=s.spec_enabled, spec_k=s.spec_k, kv_budget=kv_budget)
    return Report(
        title=title or f"PrefixLab session report: {model.name}",
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        model=model_info(model), settings=settings, system_prompt=system_prompt,
        totals=_totals(scheduler, records, rows), requests=records, timeline=rows,
        chains=[dataclasses.replace(c) for c in prefix_chain_list(scheduler.cache)],
        pages=_page_map(scheduler), machine=MachineInfo(**machine()), versions=versions())


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


__all__ = [
    "SCHEMA", "SCHEMA_NAME", "SCHEMA_VERSION", "MachineInfo", "ModelInfo", "PageMapState", "Report",
    "READABLE_VERSIONS", "ReportSettings", "Totals", "build_report", "file_sha256", "model_info",
    "snapshot_from_report",
]
