"""Traces: requests as JSONL, read one line at a time (schema in docs/trace-schema.md).

Three line formats. `prefixlab`: a header line, then one request per line with
its prompt as token ids (or block hash ids). `mooncake`: the Mooncake/Bailian
hash-id form (`timestamp` ms, `input_length`, `output_length`, `hash_ids`).
`openai`: one chat request body per line, tokenized with a model's template.
Files are never loaded whole: a `TraceSource` re-opens and streams its file on
every iteration, so a 2 GB trace costs one line of memory at a time.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

from ..report.files import ReportWriteError, atomic_write
from ..stop_signals import TerminateRaises

FORMATS = ("mooncake", "openai", "prefixlab")
PREFIXLAB_TAG = "prefixlab.trace/1"
MOONCAKE_BLOCK = 512
# A line is one request: 16 MiB of JSON is past any context. Longer lines are skipped (their
# bytes read and dropped, never kept), so a runaway line costs this much memory at most.
MAX_LINE_BYTES = 16 << 20
MAX_HASH_IDS = 1 << 18   # blocks of one request: a 2M-token prompt at 8 tokens a block
MAX_SKIPPED_SHOWN = 5
COMPRESSED_MAGIC = (b"\x1f\x8b", b"\x28\xb5\x2f\xfd", b"BZh", b"\xfd7zXZ")  # gzip, zstd, bzip2, xz


class Skipped:
    """Bad lines left out of a lenient read: how many, and the first few as {line, why}."""

    def __init__(self):
        self.count = 0
        self.examples: list[dict] = []

    def add(self, line: int, why: str) -> None:
        self.count += 1
        if len(self.examples) < MAX_SKIPPED_SHOWN:
            self.examples.append({"line": line, "why": why})

    def summary(self, path: str) -> str:
        return skipped_summary(path, self.count, self.examples)


def skipped_summary(path: str, count: int, examples: list[dict]) -> str:
    """One line for the person running the command ("" when nothing was skipped)."""
    if not count:
        return ""
    first = examples[0]
    return (f"{path}: skipped {count:,} bad line(s), e.g. line {first['line']}: {first['why']} "
            f"(--strict refuses the trace instead)")


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file and line."""


class LineError(TraceError):
    """One bad line: a lenient read skips and counts it (`line` and `why` say which and what)."""

    def __init__(self, path: str, line: int, why: str):
        super().__init__(f"{path}, line {line}: {why}")
        self.line, self.why = line, why


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace: its prompt (token ids or block hash ids) and what it did."""

    arrival_s: float
    input_length: int
    output_length: int = 0
    namespace: str = ""
    client: str = ""
    prompt: list[int] | None = None      # token ids (token traces)
    donated: list[int] | None = None     # tokens its session handed the cache at its end
    hash_ids: list[int] | None = None    # one id per block, the last maybe partial (hash-id traces)
    admitted_s: float | None = None      # when it attached its cached prefix (None: never ran)
    finish_s: float | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class TraceHeader:
    """The first line of a prefixlab trace: how to read the requests below it."""

    page_rows: int | None = None    # the recording session's page size (token traces)
    block_size: int | None = None   # block of `hash_ids` (hash-id traces)
    model: str = ""
    source: str = ""
    settings: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"format": PREFIXLAB_TAG, **asdict(self)}


@dataclass
class TraceSource:
    """A trace file and how to read it; iterate it (again and again) for its requests."""

    path: str
    format: str
    header: TraceHeader
    tokenize: Callable[[list[dict]], list[int]] | None = None  # openai: messages -> prompt tokens
    strict: bool = True   # a bad line stops the read; False: it is skipped and counted in `skipped`
    skipped: Skipped = field(default_factory=Skipped)  # the latest iteration's

    @property
    def hashed(self) -> bool:
        """True for hash-id traces (pages keyed by block id, no tokens)."""
        return self.format == "mooncake" or self.header.block_size is not None

    @property
    def block_size(self) -> int | None:
        return self.header.block_size

    def __iter__(self) -> Iterator[TraceRequest]:
        parse = {"mooncake": self._mooncake, "openai": self._openai,
                 "prefixlab": self._prefixlab}[self.format]
        seen, self.skipped = 0, Skipped()
        skipped = None if self.strict else self.skipped
        for lineno, obj in _objects(self.path, skip_header=self.format == "prefixlab", skipped=skipped):
            try:
                request = parse(obj, _Where(self.path, lineno))
            except LineError as e:
                if skipped is None:
                    raise
                skipped.add(e.line, e.why)
                continue
            seen += 1
            yield request
        if not seen:
            raise TraceError(f"{self.path}: the trace has no requests" + (
                f" ({self.skipped.summary(self.path)})" if self.skipped.count else ""))

    def _mooncake(self, obj: dict, at: _Where) -> TraceRequest:
        n = at.int_field(obj, "input_length", 1)
        return TraceRequest(arrival_s=at.number(obj, "timestamp") / 1000.0, input_length=n,
                            output_length=at.int_field(obj, "output_length", 0),
                            hash_ids=at.hash_ids(obj, n, self.header.block_size))

    def _prefixlab(self, obj: dict, at: _Where) -> TraceRequest:
        kw = {"arrival_s": at.number(obj, "arrival_s"),
              "output_length": at.int_field(obj, "output_length", 0, default=0),
              "namespace": at.string(obj, "namespace"), "client": at.string(obj, "client")}
        for name in ("admitted_s", "finish_s"):
            if obj.get(name) is not None:
                kw[name] = at.number(obj, name)
        if self.hashed:
            n = at.int_field(obj, "input_length", 1)
            return TraceRequest(input_length=n, hash_ids=at.hash_ids(obj, n, self.header.block_size), **kw)
        prompt = at.tokens(obj, "prompt")
        donated = at.tokens(obj, "donated") if obj.get("donated") is not None else None
        return TraceRequest(input_length=len(prompt), prompt=prompt, donated=donated, **kw)

    def _openai(self, obj: dict, at: _Where) -> TraceRequest:
        messages = obj.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise at.error("'messages' must be a non-empty list of {role, content} objects")
        try:
            prompt = self.tokenize([{"role": m["role"], "content": _text(m.get("content"))}
                                    for m in messages])
        except Exception as e:  # a template error names the message; say which line it came from
            raise at.error(f"cannot render the chat messages: {e}") from None
        # checked here, so a bad one names this file and line (not the tokenized copy's)
        limit = next((n for n in ("max_completion_tokens", "max_tokens") if obj.get(n) is not None), None)
        out = at.int_field(obj, limit, 0) if limit else 0
        arrival = at.number(obj, "timestamp") / 1000.0 if "timestamp" in obj else float(at.line - 1)
        client = " ".join(f"{k}={obj[k]}" for k in ("model", "user") if isinstance(obj.get(k), str))
        return TraceRequest(arrival_s=arrival, input_length=len(prompt), output_length=out,
                            client=client, prompt=prompt)


def _text(content) -> str:
    """An OpenAI message's content as text (a string, or a list of text parts)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise TypeError(f"message content must be a string or a list of parts, got {type(content).__name__}")


@dataclass
class _Where:
    """A line of a trace file: field readers that fail with an error naming it."""

    path: str
    line: int

    def error(self, what: str) -> LineError:
        return LineError(self.path, self.line, what)

    def _get(self, obj: dict, name: str):
        if name not in obj:
            raise self.error(f"missing field '{name}'")
        return obj[name]

    def number(self, obj: dict, name: str) -> float:
        v = self._get(obj, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise self.error(f"'{name}' must be a number >= 0 and finite, got {_shown(v)}")
        return float(v)

    def int_field(self, obj: dict, name: str, low: int, default: int | None = None) -> int:
        v = obj.get(name, default) if default is not None else self._get(obj, name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.error(f"'{name}' must be an integer, got {_shown(v)}")
        if v < low:
            what = "negative" if v < 0 else "too small"
            raise self.error(f"'{name}' is {what}: {v} (it must be >= {low})")
        return v

    def string(self, obj: dict, name: str) -> str:
        v = obj.get(name, "")
        if not isinstance(v, str):
            raise self.error(f"'{name}' must be a string, got {_shown(v)}")
        return v

    def tokens(self, obj: dict, name: str) -> list[int]:
        v = self._get(obj, name)
        if not isinstance(v, list) or not v or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
            raise self.error(f"'{name}' must be a non-empty list of token ids (integers >= 0)")
        return v

    def hash_ids(self, obj: dict, input_length: int, block: int) -> list[int]:
        v = self._get(obj, "hash_ids")
        if isinstance(v, list) and len(v) > MAX_HASH_IDS:
            raise self.error(f"{len(v):,} hash_ids: at most {MAX_HASH_IDS:,} blocks a request")
        if not isinstance(v, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in v):
            raise self.error("'hash_ids' must be a list of integers")
        need = -(-input_length // block)
        if len(v) != need:
            raise self.error(f"{len(v)} hash_ids do not fit input_length {input_length}: "
                             f"{need} blocks of {block} tokens expected")
        return v


def _shown(value) -> str:
    """A bad value as an error message shows it: short (a line may hold megabytes)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def open_regular(path: str):
    """`path` opened for binary reading if it is a regular file; a TraceError otherwise (a device
    such as /dev/zero reads without end, a FIFO blocks, a folder is no trace)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise TraceError(f"cannot open trace {path}: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        what = "a folder" if stat.S_ISDIR(mode) else "a device, FIFO or socket"
        raise TraceError(f"cannot open trace {path}: it is {what}, not a regular file (traces are "
                         f"JSONL files)")
    try:
        fh = open(path, "rb")
    except OSError as e:
        raise TraceError(f"cannot open trace {path}: {e.strerror}") from None
    if fh.peek(6).startswith(COMPRESSED_MAGIC):  # every line would be a bad one: say why once
        fh.close()
        raise TraceError(f"{path}: not UTF-8 text (a compressed file? traces are JSONL: decompress it)")
    return fh


def json_lines(path: str, skipped: Skipped | None = None) -> Iterator[tuple[int, object]]:
    """(line number, value) for every non-blank line, read one bounded line at a time; a bad line
    (too long, not UTF-8, not JSON, nested too deeply) is a LineError, or with `skipped` counted
    there and left out."""
    with open_regular(path) as fh:
        lineno = 0
        while True:
            raw = fh.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            lineno += 1
            try:
                if len(raw) > MAX_LINE_BYTES:
                    _drop_rest_of_line(fh)
                    raise LineError(path, lineno, f"the line is over {MAX_LINE_BYTES >> 20} MiB (one request "
                                                  f"per line; is this a JSONL trace?)")
                if raw.strip():
                    yield lineno, _decode(raw, path, lineno)
            except LineError as e:
                if skipped is None:
                    raise
                skipped.add(lineno, e.why)


def _drop_rest_of_line(fh) -> None:
    while True:
        piece = fh.readline(1 << 20)
        if not piece or piece.endswith(b"\n"):
            return


def _decode(raw: bytes, path: str, lineno: int):
    try:
        return json.loads(raw)
    except RecursionError:
        raise LineError(path, lineno, "not a trace line: JSON nested too deeply") from None
    except UnicodeDecodeError:
        raise LineError(path, lineno, "not UTF-8 text (a binary file? traces are JSONL)") from None
    except ValueError as e:
        raise LineError(path, lineno, f"not valid JSON ({e.args[0].split(':')[0]})") from None


def _objects(path: str, skip_header: bool, skipped: Skipped | None = None) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line; a line that is no object is a bad line."""
    first = True
    for lineno, obj in json_lines(path, skipped):
        if not isinstance(obj, dict):
            error = LineError(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
            if skipped is None:
                raise error
            skipped.add(lineno, error.why)
            continue
        if first and skip_header:
            first = False
            continue
        first = False
        yield lineno, obj


def detect_format(path: str, strict: bool = True) -> tuple[str, dict]:
    """The format of a trace from its first non-blank line (not strict: its first good line), and
    that line's object."""
    for lineno, obj in _objects(path, skip_header=False, skipped=None if strict else Skipped()):
        if obj.get("format") == PREFIXLAB_TAG:
            return "prefixlab", obj
        if "hash_ids" in obj and "timestamp" in obj:
            return "mooncake", obj
        if "messages" in obj:
            return "openai", obj
        raise TraceError(f"{path}, line {lineno}: not a trace line PrefixLab knows (expected a "
                         f"prefixlab header, a Mooncake request with 'hash_ids', or an OpenAI "
                         f"chat body with 'messages'); pass --format")
    raise TraceError(f"{path}: the trace is empty")


def open_trace(path: str, fmt: str | None = None, block_size: int | None = None,
               tokenize: Callable[[list[dict]], list[int]] | None = None, strict: bool = True) -> TraceSource:
    """A streamed trace: `fmt` None detects it; `block_size` for hash-id traces (Mooncake: 512);
    `strict` False skips and counts bad request lines (`source.skipped`) instead of stopping."""
    if fmt is not None and fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}; one of {', '.join(FORMATS)}")
    if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
        raise TraceError(f"block size must be a positive integer, got {block_size!r}")
    detected, first = detect_format(path, strict)
    fmt = fmt or detected
    header = TraceHeader()
    if fmt == "prefixlab":
        if detected != "prefixlab":
            raise TraceError(f"{path}, line 1: a prefixlab trace starts with a header line "
                             f'{{"format": "{PREFIXLAB_TAG}", ...}}')
        header = _header(first, _Where(path, 1))
        if block_size is not None and block_size != header.block_size:
            raise TraceError(f"{path}: its header says block_size {header.block_size}, not {block_size}")
    elif fmt == "mooncake":
        header = TraceHeader(block_size=block_size or MOONCAKE_BLOCK, source="mooncake")
    elif tokenize is None:
        raise TraceError(f"{path}: an OpenAI request log needs a model to tokenize it (--model)")
    else:
        header = TraceHeader(source="openai")
    return TraceSource(path=path, format=fmt, header=header, tokenize=tokenize, strict=strict)


def _header(obj: dict, at: _Where) -> TraceHeader:
    kw = {}
    for name in ("page_rows", "block_size"):
        if obj.get(name) is not None:
            kw[name] = at.int_field(obj, name, 1)
    if "page_rows" not in kw and "block_size" not in kw:
        raise at.error("the header needs 'page_rows' (token traces) or 'block_size' (hash-id traces)")
    settings = obj.get("settings") or {}
    if not isinstance(settings, dict):
        raise at.error("'settings' must be an object")
    return TraceHeader(model=at.string(obj, "model"), source=at.string(obj, "source"),
                       settings=settings, **kw)


def write_trace(path: str, header: TraceHeader, requests) -> int:
    """Write a prefixlab trace atomically (a temporary file, then a rename); return the request count."""
    return _write_lines(path, [header.to_json()], (r.to_json() for r in requests))


def write_mooncake(path: str, rows) -> int:
    """Write Mooncake-form rows (dicts) atomically; return how many."""
    return _write_lines(path, [], rows)


def _write_lines(path: str, head: list[dict], rows) -> int:
    count = [0]

    def write(fh) -> None:
        for obj in head:
            fh.write(json.dumps(obj, separators=(",", ":"), allow_nan=False).encode() + b"\n")
        for obj in rows:
            fh.write(json.dumps(obj, separators=(",", ":"), allow_nan=False).encode() + b"\n")
            count[0] += 1
    try:
        with TerminateRaises():  # `kill` mid-write: the temporary file goes, as on Ctrl+C
            atomic_write(path, write)  # a bad source line or a full disk leaves the old file as it was
    except ReportWriteError as e:
        raise TraceError(f"cannot write trace {path}: {e.reason}") from None
    return count[0]
