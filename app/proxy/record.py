"""The proxy's recording: one JSONL line per request (arrival, body, model, the upstream's usage).

Never a header: the API key is kept only as its non-secret tenant hash (the routing key
hosted caches partition by), so a recording can be shared.
"""

from __future__ import annotations

import json
import os
import threading
import time
import zlib
from collections.abc import Callable

from ..advise.traffic import MAX_LINE_BYTES
from ..serve.server import tenant_of

BODY_ROOM = MAX_LINE_BYTES - (64 << 10)  # a recorded line must stay readable by the advisor
KEY_HEADERS = ("authorization", "x-api-key", "api-key")


def routing_key(headers) -> str:
    """The non-secret tenant of the request's API key ("" without one)."""
    for name in KEY_HEADERS:
        value = headers.get(name)
        if value:
            key = value[7:].strip() if value.lower().startswith("bearer ") else value.strip()
            return tenant_of(key)
    return ""


class UsageReader:
    """The usage (and llama.cpp timings) in an answer, read as its bytes pass by."""

    def __init__(self, encoding: str, streaming: bool):
        self.streaming = streaming
        self.usage: dict | None = None
        self.timings: dict | None = None
        self._decoder = zlib.decompressobj(47) if encoding in ("gzip", "deflate") else None
        self._readable = encoding in ("", "identity", "gzip", "deflate")
        self._buf = b""

    def feed(self, raw: bytes) -> None:
        """Some raw bytes of the answer."""
        if not self._readable:
            return
        try:
            data = self._decoder.decompress(raw) if self._decoder else raw
        except zlib.error:  # an encoding we misread: the answer still passes, its usage is not read
            self._readable = False
            return
        if not self.streaming:
            self._buf += data
            return
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data:") and line[5:].strip() not in (b"", b"[DONE]"):
                self._take(line[5:])

    def finish(self) -> None:
        """The answer is complete: read a whole JSON body."""
        if self._readable and not self.streaming and self._buf:
            self._take(self._buf)
        self._buf = b""

    def _take(self, text: bytes) -> None:
        try:
            obj = json.loads(text)
        except ValueError:
            return
        if isinstance(obj, dict):
            self.usage = obj["usage"] if isinstance(obj.get("usage"), dict) else self.usage
            self.timings = obj["timings"] if isinstance(obj.get("timings"), dict) else self.timings


class Recorder:
    """Appends a line per finished request to a JSONL file (thread-safe); observers see each record."""

    def __init__(self, path: str | None):
        self.path = path
        self.observers: list[Callable[[dict], None]] = []
        self._lock = threading.Lock()
        self.count = 0
        if path:
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                raise ValueError(f"cannot record to {path}: the folder {folder} does not exist")
            try:
                open(path, "a", encoding="utf-8").close()
            except OSError as e:
                raise ValueError(f"cannot record to {path}: {e.strerror}") from None

    def record(self, arrival: float, endpoint: str, key: str, body: bytes, status: int,
               usage: UsageReader | None, error: str = "") -> dict:
        """Write one request's line; returns the record."""
        rec: dict = {"timestamp": round(arrival * 1000, 3), "endpoint": endpoint, "status": status}
        if key:
            rec["key"] = key
        parsed = None
        if len(body) <= BODY_ROOM:
            try:
                parsed = json.loads(body)
            except ValueError:
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
        if error:
            rec["error"] = error
        return self.write(rec)

    def write(self, rec: dict) -> dict:
        """Append one record as a line and tell the observers."""
        line = json.dumps(rec, ensure_ascii=False) + "\n"
        with self._lock:
            self.count += 1
            if self.path:
                with open(self.path, "a", encoding="utf-8") as fh:
                    fh.write(line)
        for observe in list(self.observers):
            observe(rec)
        return rec


def now() -> float:
    """Arrival time as the recording keeps it: seconds since the epoch."""
    return time.time()
