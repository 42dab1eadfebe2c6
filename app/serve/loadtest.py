"""Concurrent streaming clients against any OpenAI-compatible server (the serve bench's load).

Each client streams one chat answer; the figures are the wall time from the
first request sent to the last token received, each request's TTFT, and the
cached prompt tokens the server reports (None from servers that do not).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from engine.metrics import hit_rate

READY_TIMEOUT_S = 300.0


@dataclass
class ClientResult:
    """One streamed answer as a client saw it."""

    ttft_s: float | None
    done_s: float
    pieces: int
    text: str
    prompt_tokens: int | None
    cached_tokens: int | None


def stream_chat(base_url: str, messages: list[dict], max_tokens: int, t0: float, extra: dict,
                client: httpx.Client) -> ClientResult:
    """One streaming chat completion; times are seconds after `t0`."""
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    ttft, pieces, text, usage = None, 0, [], None
    with client.stream("POST", base_url + "/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{base_url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ch = json.loads(line[6:])
            usage = ch.get("usage") or usage
            for choice in ch.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    ttft = time.perf_counter() - t0 if ttft is None else ttft
                    pieces += 1
                    text.append(content)
    details = (usage or {}).get("prompt_tokens_details") or {}
    return ClientResult(ttft, time.perf_counter() - t0, pieces, "".join(text),
                        (usage or {}).get("prompt_tokens"), details.get("cached_tokens"))


def run_clients(base_url: str, system: str, prompts: list[str], max_tokens: int,
                extra: dict | None = None) -> dict:
    """All prompts at once, one client thread each; wall from first request to last token."""
    start: list[float] = []
    barrier = threading.Barrier(len(prompts), action=lambda: start.append(time.perf_counter()))
    with httpx.Client(timeout=600) as client, ThreadPoolExecutor(len(prompts)) as pool:

        def one(q: str) -> ClientResult:
            barrier.wait()  # every client sends at once; the clock starts as they go
            messages = [{"role": "system", "content": system}, {"role": "user", "content": q}]
            return stream_chat(base_url, messages, max_tokens, start[0], extra or {}, client)

        results = list(pool.map(one, prompts))
    prompt = [r.prompt_tokens for r in results]
    cached = [r.cached_tokens for r in results]
    known = None not in cached and None not in prompt
    return {
        "wall_s": max(r.done_s for r in results),
        "ttft_s": [r.ttft_s for r in results],
        "pieces": [r.pieces for r in results],
        "texts": [r.text for r in results],
        "cached_tokens": cached,
        # usage's cached tokens are the saved ones; the rest of the prompt was computed
        "hit_rate": hit_rate(sum(cached), sum(prompt) - sum(cached)) if known else None,
    }


def start_server(cmd: list[str], base_url: str, env: dict | None = None,
                 ready_path: str = "/v1/models") -> subprocess.Popen:
    """Start a server process and wait until `ready_path` answers 200 (or raise with its output)."""
    # A file, not a pipe: a chatty server (llama.cpp logs every tensor) would fill a pipe and block.
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log = log
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            output = log.read()[-800:]
            raise RuntimeError(f"{' '.join(cmd[:4])}... exited with {proc.returncode}: {output}")
        try:
            if httpx.get(base_url.rsplit("/v1", 1)[0] + ready_path, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(proc)
    raise RuntimeError(f"{' '.join(cmd[:4])}... was not ready within {READY_TIMEOUT_S:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    """End a server process (terminate, then kill) and close its log."""
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.log.close()


def python() -> str:
    """This interpreter, for child servers."""
    return sys.executable
