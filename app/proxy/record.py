"""The proxy's recording: one JSONL line per request (arrival, body, model, the upstream's usage).

Never a header: the API key is kept only as its non-secret tenant hash (the routing key
hosted caches partition by), and every string recorded has this request's key values and
anything shaped like a key redacted, so a recording can be shared. Lines are strict JSON
(no NaN or Infinity), the file is private to its owner (0600) and rotated at a size cap.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
import zlib
from collections.abc import Callable

from ..advise.traffic import MAX_LINE_BYTES
from ..serve.server import tenant_of
from .limits import DEFAULT_MAX_DECODED_BYTES, DEFAULT_MAX_LINE_BYTES, DEFAULT_RECORD_MAX_BYTES

BODY_ROOM = MAX_LINE_BYTES - (64 << 10)  # a recorded line must stay readable by the advisor
KEY_HEADERS = ("authorization", "x-api-key", "api-key")
DECODE_SLICE = 1 << 20  # a compressed answer is inflated this much at a time: memory stays bounded
MIN_SECRET_CHARS = 6  # a shorter key cannot be told from ordinary text; redacting it would mangle the line
KEY_PATTERNS = re.compile(r"(?i)\bbearer\s+[^\s\"',;]+|\bsk-[A-Za-z0-9_\-]{8,}")
REDACTED = "[redacted]"
log = logging.getLogger("prefixlab.proxy")


def routing_key(headers) -> str:
    """The non-secret tenant of the request's API key ("" without one)."""
    for name in KEY_HEADERS:
        value = headers.get(name)
        if value:
            key = value[7:].strip() if value.lower().startswith("bearer ") else value.strip()
            return tenant_of(key)
    return ""


def secrets_in(headers) -> list[str]:
    """The key values this request carries (the whole header and the bare token), longest first."""
    found = set()
    for name in KEY_HEADERS:
        value = (headers.get(name) or "").strip()
        found.update({value, value[7:].strip() if value.lower().startswith("bearer ") else value})
    return sorted((s for s in found if len(s) >= MIN_SECRET_CHARS), key=len, reverse=True)


def redact(value, secrets: list[str]):
    """`value` with every string (keys too) free of `secrets` and of Bearer/sk- key shapes."""
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
        return KEY_PATTERNS.sub(REDACTED, value)
    if isinstance(value, dict):
        return {redact(k, secrets): redact(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, secrets) for v in value]
    return value


def _finite(text: str) -> float | None:
    number = float(text)
    return number if math.isfinite(number) else None


def strict_loads(data: bytes | str):
    """JSON as the recording keeps it: NaN, Infinity and numbers past a float's range become null."""
    return json.loads(data, parse_constant=lambda _name: None, parse_float=_finite)


class UsageReader:
    """The usage (and llama.cpp timings) in an answer, read as its bytes pass by.

    Bounded whatever the upstream sends: a compressed answer is inflated a slice at a time
    and only up to `max_decoded` bytes (a stream's too: a 1 MB gzip bomb is 1 GB of work), a
    whole answer is read up to `max_decoded` bytes, an event stream one line at a time (each
    line scanned once; a line over `max_line` is skipped, not kept). Past a bound the answer
    still passes; only its usage goes unread."""

    def __init__(self, encoding: str, streaming: bool, max_decoded: int = DEFAULT_MAX_DECODED_BYTES,
                 max_line: int = DEFAULT_MAX_LINE_BYTES):
        self.streaming, self.max_decoded, self.max_line = streaming, max_decoded, max_line
        self.usage: dict | None = None
        self.timings: dict | None = None
        self.unread = ""  # why the usage could not be read, when it could not
        encoding = encoding.strip().lower()
        self._decoder = zlib.decompressobj(47) if encoding in ("gzip", "x-gzip", "deflate") else None
        self._readable = encoding in ("", "identity", "gzip", "x-gzip", "deflate")
        self._buf = bytearray()  # a whole answer, or the stream's unfinished line
        self._skipping = False  # inside an over-long line: drop bytes up to its newline
        self._decoded = 0  # bytes decoded so far

    @property
    def inflating(self) -> bool:
        """Whether feeding costs inflating a compressed answer (work worth taking off the event loop)."""
        return self._decoder is not None and self._readable

    def feed(self, raw: bytes) -> None:
        """Some raw bytes of the answer."""
        if not self._readable:
            return
        if self._decoder is None:
            self._take_decoded(raw)
            return
        data = raw
        while data and self._readable:
            try:
                out = self._decoder.decompress(data, DECODE_SLICE)
            except zlib.error:  # an encoding we misread: the answer still passes, its usage is not read
                self._give_up("the answer's compression could not be read")
                return
            self._take_decoded(out)
            data = self._decoder.unconsumed_tail

    def _take_decoded(self, data: bytes) -> None:
        self._decoded += len(data)
        # a whole answer is held, a compressed one inflated: both bounded (a plain stream is read
        # as it passes, at the cost of passing it)
        if self._decoded > self.max_decoded and (self._decoder is not None or not self.streaming):
            self._give_up(f"the answer decodes to over {self.max_decoded:,} bytes (--max-decoded-bytes)")
            return
        if not self.streaming:
            self._buf += data
            return
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            if self._skipping:
                self._skipping = False
            elif len(self._buf) + end - start <= self.max_line:
                self._buf += data[start:end]
                self._line(bytes(self._buf))
            self._buf.clear()
            start = end + 1
        if not self._skipping and len(self._buf) + len(data) - start > self.max_line:
            self._skipping = True  # an over-long line: nothing of it is kept
            self._buf.clear()
        elif not self._skipping:
            self._buf += data[start:]

    def _line(self, line: bytes) -> None:
        if line.startswith(b"data:") and line[5:].strip() not in (b"", b"[DONE]"):
            self._take(line[5:])

    def _give_up(self, why: str) -> None:
        self._readable, self.unread = False, why
        self._buf = bytearray()

    def finish(self) -> None:
        """The answer is complete: read a whole JSON body."""
        if self._readable and not self.streaming and self._buf:
            self._take(bytes(self._buf))
        self._buf = bytearray()

    def _take(self, text: bytes) -> None:
        try:
            obj = strict_loads(text)
        except (ValueError, RecursionError):
            return
        if isinstance(obj, dict):
            if isinstance(obj.get("message"), dict) and isinstance(obj["message"].get("usage"), dict):
                obj = obj["message"]  # Anthropic's message_start event carries the input's usage
            if isinstance(obj.get("usage"), dict):  # a later event's (message_delta's) fields add to it
                self.usage = {**(self.usage or {}), **obj["usage"]}
            self.timings = obj["timings"] if isinstance(obj.get("timings"), dict) else self.timings


class Recorder:
    """Appends a line per finished request to a JSONL file (thread-safe); observers see each record.

    The file is created 0600; a line that would take it past `max_bytes` first moves it to
    `<path>.1` (replacing an older one), so the recording holds at most twice the cap."""

    def __init__(self, path: str | None, max_bytes: int = DEFAULT_RECORD_MAX_BYTES):
        if max_bytes < 1:
            raise ValueError(f"--record-max-bytes must be >= 1, got {max_bytes}")
        self.path, self.max_bytes = path, max_bytes
        self.observers: list[Callable[[dict], None]] = []
        self._lock = threading.Lock()
        self.count = 0
        if path:
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                raise ValueError(f"cannot record to {path}: the folder {folder} does not exist")
            try:
                os.close(self._open())
            except OSError as e:
                raise ValueError(f"cannot record to {path}: {e.strerror}") from None

    def _open(self) -> int:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.fchmod(fd, 0o600)  # a file that was there before is made private too
        return fd

    def record(self, arrival: float, endpoint: str, headers, body: bytes, status: int,
               usage: UsageReader | None, error: str = "", first_byte: float | None = None) -> dict:
        """Write one request's line (`headers`: the request's, for its routing key and the key
        values to redact; `first_byte`: when the answer began, the time a hosted cache's entry
        becomes readable); returns the record."""
        rec: dict = {"timestamp": round(arrival * 1000, 3), "endpoint": endpoint, "status": status}
        if first_byte is not None:
            rec["first_byte_ms"] = round(max(0.0, first_byte - arrival) * 1000, 3)
        key = routing_key(headers)
        if key:
            rec["key"] = key
        parsed = None
        if len(body) <= BODY_ROOM:
            try:
                parsed = strict_loads(body)
            except (ValueError, RecursionError):
                rec["body_error"] = "the request body is not JSON"
        else:
            rec["body_omitted"] = f"{len(body):,} bytes, over what a trace line may hold"
        if isinstance(parsed, dict):
            rec["model"] = parsed.get("model", "")
            rec["body"] = parsed
        if usage is not None and usage.usage is not None:
            rec["usage"] = usage.usage
        if usage is not None and usage.timings is not None:
            rec["timings"] = usage.timings
        if usage is not None and usage.unread:  # the advisor says why it has no usage to check against
            rec["usage_unread"] = usage.unread
        if error:
            rec["error"] = error
        try:
            rec = redact(rec, secrets_in(headers))
        except RecursionError:  # JSON nested past what can be walked: the line keeps no body
            rec.pop("body", None)
            rec = {**redact(rec, secrets_in(headers)),
                   "body_error": "the request body nests too deeply to record"}
        return self.write(rec)

    def write(self, rec: dict) -> dict:
        """Append one record as a strict-JSON line (rotating at the cap) and tell the observers;
        a disk that refuses the line costs the line, with one log message, never the request."""
        try:
            line = (json.dumps(rec, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8", "replace")
        except (ValueError, RecursionError) as e:  # a non-finite number or a nest past walking
            log.warning("prefixlab proxy: a record was not written: %s", e)
            line = b""
        with self._lock:
            self.count += 1
            if self.path and line:
                try:
                    self._append(line)
                except OSError as e:
                    log.warning("prefixlab proxy: a record was not written to %s: %s", self.path, e.strerror)
        for observe in list(self.observers):
            observe(rec)
        return rec

    def _append(self, line: bytes) -> None:
        fd = self._open()
        try:
            size = os.fstat(fd).st_size
            if size and size + len(line) > self.max_bytes:
                os.close(fd)
                fd = -1
                os.replace(self.path, self.path + ".1")
                fd = self._open()
            os.write(fd, line)
        finally:
            if fd >= 0:
                os.close(fd)


def now() -> float:
    """Arrival time as the recording keeps it: seconds since the epoch."""
    return time.time()
