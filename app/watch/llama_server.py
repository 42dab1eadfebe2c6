"""Watch a llama.cpp server, which has no event feed: poll `GET /slots` and `/metrics` (docs/design.md §9).

The shapes vary by llama.cpp version (documented in its tools/server/README.md):
a slot has `id`, `n_ctx` and `is_processing` (older builds: `state` 0 idle / 1
busy), `id_task` (older: `task_id`), `next_token` as an object (some builds: a
one-element list) with `n_decoded`, and, in builds that report them,
`n_prompt_tokens` and `n_prompt_tokens_cache`. `/metrics` (server started with
`--metrics`) is Prometheus text with counters such as
`llamacpp:prompt_tokens_total` and `llamacpp:tokens_predicted_total`.
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field


@dataclass
class SlotInfo:
    """One llama.cpp slot as the poller reads it (None: this build does not report it)."""

    id: int
    n_ctx: int | None
    processing: bool
    task: int | None
    n_decoded: int | None
    n_prompt_tokens: int | None
    n_prompt_tokens_cache: int | None


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")


def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def parse_slots(data) -> list[SlotInfo]:
    """The slots of a `/slots` answer (parsed JSON); ValueError naming what is wrong."""
    if not isinstance(data, list):
        raise ValueError(f"/slots answered a {type(data).__name__}, expected a JSON array of slots")
    out = []
    for i, s in enumerate(data):
        if not isinstance(s, dict) or _int(s.get("id")) is None:
            raise ValueError(f"/slots entry {i} is not a slot object with an integer id")
        busy = s.get("is_processing")
        if not isinstance(busy, bool):
            busy = s.get("state") not in (None, 0)
        nxt = s.get("next_token")
        if isinstance(nxt, list):
            nxt = nxt[0] if nxt else None
        nxt = nxt if isinstance(nxt, dict) else {}
        task = s.get("id_task", s.get("task_id"))
        out.append(SlotInfo(s["id"], _int(s.get("n_ctx")), busy, _int(task), _int(nxt.get("n_decoded")),
                            _int(s.get("n_prompt_tokens")), _int(s.get("n_prompt_tokens_cache"))))
    return out


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {name: value}; labelled samples of one name are summed, junk lines skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m is None:
            continue
        try:
            value = float(m.group(2))
        except ValueError:
            continue
        if math.isfinite(value):
            out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


@dataclass
class LlamaSample:
    """One poll: the slots, the metrics and the rates since the previous poll."""

    ts: float
    slots: list[SlotInfo]
    metrics: dict[str, float]
    prompt_tokens_per_s: float | None = None
    predicted_tokens_per_s: float | None = None
    errors: list[str] = field(default_factory=list)

    def line(self) -> str:
        """The line the CLI prints for this poll."""
        busy = sum(s.processing for s in self.slots)
        cached = sum(s.n_prompt_tokens_cache or 0 for s in self.slots)
        rate = "" if self.predicted_tokens_per_s is None else (
            f" prompt {self.prompt_tokens_per_s:.1f} tok/s,"
            f" predicted {self.predicted_tokens_per_s:.1f} tok/s")
        err = f" ({'; '.join(self.errors)})" if self.errors else ""
        return f"{len(self.slots)} slots, {busy} busy, {cached} cached prompt tokens{rate}{err}"


class LlamaServerPoller:
    """Polls one llama.cpp server; each `poll()` returns a `LlamaSample` (errors kept, never raised)."""

    def __init__(self, url: str, timeout: float = 2.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--llama-server wants an http(s) URL like http://127.0.0.1:8080, got {url!r}")
        self.url, self.timeout = url.rstrip("/"), timeout
        self.samples: list[LlamaSample] = []
        self._prev: tuple[float, dict] | None = None

    def _get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=self.timeout) as r:  # noqa: S310 - user's URL
            return r.read(16 * 1024 * 1024)

    def poll(self) -> LlamaSample:
        """Read /slots and /metrics once; what failed is in the sample's errors."""
        sample = LlamaSample(time.time(), [], {})
        try:
            sample.slots = parse_slots(json.loads(self._get("/slots")))
        except (OSError, ValueError) as e:
            sample.errors.append(f"/slots: {e}")
        try:
            sample.metrics = parse_metrics(self._get("/metrics").decode("utf-8", "replace"))
        except (OSError, ValueError) as e:
            sample.errors.append(f"/metrics: {e} (start llama-server with --metrics)")
        if sample.metrics and self._prev is not None:
            t0, m0 = self._prev
            dt = max(sample.ts - t0, 1e-6)
            rate = lambda k: max(0.0, sample.metrics.get(k, 0.0) - m0.get(k, 0.0)) / dt  # noqa: E731
            sample.prompt_tokens_per_s = rate("llamacpp:prompt_tokens_total")
            sample.predicted_tokens_per_s = rate("llamacpp:tokens_predicted_total")
        if sample.metrics:
            self._prev = (sample.ts, sample.metrics)
        self.samples = (self.samples + [sample])[-3600:]
        return sample

    def to_json(self) -> dict:
        """Every sample kept (the last hour at one poll a second)."""
        return {"url": self.url, "samples": [asdict(s) for s in self.samples]}
