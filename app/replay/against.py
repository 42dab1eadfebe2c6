"""`prefixlab replay TRACE --against URL`: send the trace to a running OpenAI-compatible server at
the trace's own arrival times (divided by `--speed`) and measure each request (docs/design.md §16).

Prompts go as token ids to `/v1/completions` (prefixlab serve, vLLM and llama.cpp's server take a
list of ids), rebuilt as the twin rebuilds them (`app.replay.twin.prompt_of`: a hash-id trace's
same hash id is the same block of ids), so server and twin see the same prompts. Answers stream,
with `ignore_eos` so each runs to the trace's output length. A request's TTFT is its first
streamed piece minus its scheduled arrival; its total, its last piece minus that arrival. A
server streams a piece only for a token with text, so the prompts are ASCII tokens (answers
then are too) and `pieces` beside `tokens` shows when they were not.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx
import numpy as np

from .trace import TraceSource
from .twin import prompt_of

PERCENTILES = (50, 90, 99)


@dataclass
class Measured:
    """One request as the client saw it (seconds after its scheduled arrival)."""

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    ttft_s: float | None = None
    total_s: float | None = None
    tokens: int | None = None          # completion tokens, as the server's usage reports them
    cached_tokens: int | None = None
    pieces: int = 0                    # streamed pieces with text (fewer than tokens: some had none)
    error: str | None = None


def requests_of(source: TraceSource, speed: float) -> list[tuple[float, list[int], int]]:
    """(arrival s, prompt ids, output length) of every request, arrivals divided by `speed`."""
    block = source.block_size if source.hashed else None
    return [(r.arrival_s / speed, prompt_of(r, block), max(1, r.output_length)) for r in source]


async def _one(client: httpx.AsyncClient, url: str, model: str, i: int, req, start: float) -> Measured:
    arrival, prompt, n_out = req
    m = Measured(i, arrival, len(prompt), n_out)
    await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
    due = start + arrival
    body = {"model": model, "prompt": prompt, "max_tokens": n_out, "stream": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                m.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return m
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                usage = obj.get("usage") or {}
                m.tokens = usage.get("completion_tokens", m.tokens)
                details = usage.get("prompt_tokens_details") or {}
                m.cached_tokens = details.get("cached_tokens", m.cached_tokens)
                if obj.get("choices"):
                    m.pieces += bool(obj["choices"][0].get("text"))
                    now = time.perf_counter() - due
                    m.ttft_s = now if m.ttft_s is None else m.ttft_s
                    m.total_s = now
    except httpx.HTTPError as e:
        m.error = f"{type(e).__name__}: {e}"
    return m


async def _send_all(url: str, reqs, model: str | None) -> list[Measured]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # a burst all at once
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        if model is None:
            listed = (await client.get(url + "/v1/models")).json().get("data") or [{}]
            model = listed[0].get("id", "")
        start = time.perf_counter() + 0.2  # every task is waiting before the first is due
        tasks = (_one(client, url, model, i, r, start) for i, r in enumerate(reqs))
        return list(await asyncio.gather(*tasks))


def send(url: str, source: TraceSource, speed: float = 1.0, model: str | None = None) -> list[Measured]:
    """Send every request of the trace at its time; the measured requests in trace order."""
    return send_requests(url, requests_of(source, speed), model)


def send_requests(url: str, reqs: list[tuple[float, list[int], int]],
                  model: str | None = None) -> list[Measured]:
    """Send (arrival s, prompt ids, output length) requests, each at its time, streamed."""
    base = url.rstrip("/")
    base = base[:-3] if base.endswith("/v1") else base
    return asyncio.run(_send_all(base, reqs, model))


def percentiles(values) -> dict:
    a = np.asarray(list(values), dtype=np.float64)
    return {f"p{q}": float(v) for q, v in zip(PERCENTILES, np.percentile(a, PERCENTILES))} if len(a) else {}


def compare(measured: list[Measured], draws: list[dict]) -> dict:
    """Measured beside predicted: the p50/p90/p99 of TTFT and of total time, and each one's
    relative error (predicted - measured) / measured. `draws`: per draw of the twin
    (twin_replay.predict_draws), index -> Predicted; a percentile predicted is its mean over them."""
    ok = [m for m in measured if m.error is None and m.ttft_s is not None and m.index in draws[0]]
    out = {"requests": len(measured), "measured_ok": len(ok), "draws": len(draws),
           "errors": [f"request {m.index}: {m.error}" for m in measured if m.error][:10]}
    for name, got, want in (("ttft", lambda m: m.ttft_s, lambda p: p.ttft_s),
                            ("total", lambda m: m.total_s, lambda p: p.end_s - p.arrival_s)):
        meas = percentiles(got(m) for m in ok)
        each = [percentiles(want(run[m.index]) for m in ok) for run in draws]
        pred = {q: float(np.mean([p[q] for p in each])) for q in meas}
        out[name] = {"measured": meas, "predicted": pred,
                     "error": {q: (pred[q] - meas[q]) / meas[q] if meas[q] else None for q in meas}}
    return out


def table(measured: list[Measured], predicted: dict) -> str:
    """Per request: measured beside predicted TTFT and total, seconds."""
    lines = ["  req  arrival s  prompt  out  TTFT meas  TTFT pred  total meas  total pred"]
    for m in measured:
        p = predicted.get(m.index)
        head = f"{m.index:5d}  {m.arrival_s:9.2f}  {m.input_length:6d}  {m.output_length:3d}  "
        if m.error:
            lines.append(head + m.error)
            continue
        lines.append(f"{head}{m.ttft_s:9.3f}  {p.ttft_s if p else float('nan'):9.3f}  {m.total_s:10.3f}  "
                     f"{(p.end_s - p.arrival_s) if p else float('nan'):10.3f}")
    return "\n".join(lines)


def summary(cmp: dict) -> str:
    draws = cmp.get("draws", 1)
    lines = [f"measured {cmp['measured_ok']} of {cmp['requests']} requests"
             + (f"; predicted: the mean of {draws} draws of the twin" if draws > 1 else "")]
    for name, label in (("ttft", "TTFT"), ("total", "total")):
        c = cmp[name]
        for q in c["measured"]:
            err = c["error"][q]
            lines.append(f"  {label} {q}: measured {c['measured'][q]:.3f} s, predicted "
                         f"{c['predicted'][q]:.3f} s, error " + (f"{err:+.1%}" if err is not None else "-"))
    lines += [f"  {e}" for e in cmp["errors"]]
    return "\n".join(lines)
