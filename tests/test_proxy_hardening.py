"""`prefixlab proxy` against hostile upstreams and hostile clients (issue 45): real HTTP servers on
free loopback ports, the real httpx and openai clients, the proxy's own process measured where
memory is the point. Every exchange is bounded, the key never reaches the disk, the recording
is strict JSON, private and capped."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import os
import re
import secrets
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import zlib
from contextlib import contextmanager

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.proxy.cli import Proxy
from app.proxy.limits import Limits
from app.serve.runner import HttpThread

KEY = "sk-hardening-" + secrets.token_hex(16)
OTHER_KEY = "azure-" + secrets.token_hex(16)
ASK = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "What glue works on wood?"}]}
MODELS = {"object": "list", "data": [{"id": "m", "object": "model", "created": 1, "owned_by": "test"}]}
ANSWER = {"id": "c", "object": "chat.completion", "created": 1, "model": "m",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "Wood glue."},
                       "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}}
EVENT = b'data: {"choices": []}\n\n'
MiB = 1 << 20


# --- a tiny upstream: raw ASGI handlers by path, on a real uvicorn ---------------------------------

def upstream(routes: dict) -> HttpThread:
    """A real HTTP server on a free loopback port; `routes` maps a path ("*": any) to a raw ASGI handler."""
    async def app(scope, receive, send):
        if scope["type"] == "http":
            await (routes.get(scope["path"]) or routes["*"])(scope, receive, send)
    return HttpThread(app, "127.0.0.1", 0).start()


async def answer(send, status: int, body: bytes, content_type: bytes = b"application/json",
                 headers=()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


async def models(scope, receive, send):
    await answer(send, 200, json.dumps(MODELS).encode())


async def chat(scope, receive, send):
    await answer(send, 200, json.dumps(ANSWER).encode())


def strict(line: str):
    """A JSON line parsed as a strict reader would: NaN and Infinity are errors."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(line, parse_constant=refuse)


@contextmanager
def running(*things):
    try:
        yield things
    finally:
        for thing in reversed(things):
            thing.stop()


@contextmanager
def proxy_process(upstream_url: str, *flags: str):
    """`prefixlab proxy` as its own process (its memory is measured): (its URL, its pid)."""
    command = [sys.executable, "-m", "app.cli", "proxy", "--upstream", upstream_url, "--port", "0", *flags]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        found = re.search(r"(http://127\.0\.0\.1:\d+)/v1 -> ", first)
        assert found, f"the proxy did not start: {first}"
        yield found.group(1), proc.pid
    finally:
        proc.terminate()
        proc.wait(20)


def peak_rss(pid: int) -> int:
    """The process's high-water resident memory in bytes (VmHWM)."""
    with open(f"/proc/{pid}/status") as fh:
        return int(re.search(r"VmHWM:\s+(\d+) kB", fh.read()).group(1)) * 1024


def gzip_bomb(mib: int) -> bytes:
    """A valid gzip stream of `mib` MiB of zeros in about 1 KB per MiB, built without deflating it all:
    after a full flush, deflate's output for the same input repeats."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    zeros = bytes(MiB)
    first = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    again = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    for _ in range(mib):
        crc = zlib.crc32(zeros, crc)
    return (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff" + first + again * (mib - 1) + c.flush()
            + struct.pack("<II", crc, (mib * MiB) & 0xFFFFFFFF))


# --- 1. a silent upstream cannot hang the proxy -----------------------------------------------------

def test_a_silent_upstream_cannot_hold_the_pool_once_clients_give_up():
    """105 requests to an upstream that never answers, clients giving up after 2 s: their upstream
    requests are cancelled with them, and a later request answers at once (a pool of 100)."""
    open_upstream = []  # one item per upstream request still open

    async def silent(scope, receive, send):
        open_upstream.append(1)
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        finally:
            open_upstream.pop()

    with running(upstream({"/v1/chat/completions": silent, "/v1/models": models})) as (up,), \
            running(Proxy(up.url + "/v1", port=0).start()) as (proxy,):
        async def clients_giving_up():
            async with httpx.AsyncClient(timeout=2, limits=httpx.Limits(max_connections=200)) as c:
                async def one():
                    with pytest.raises(httpx.ReadTimeout):
                        await c.post(proxy.url + "/v1/chat/completions", json=ASK)
                await asyncio.gather(*(one() for _ in range(105)))
        asyncio.run(clients_giving_up())
        start = time.monotonic()
        r = httpx.get(proxy.url + "/v1/models", timeout=5)
        assert r.status_code == 200 and r.json() == MODELS and time.monotonic() - start < 5
        end = time.monotonic() + 5
        while open_upstream and time.monotonic() < end:
            time.sleep(0.05)
        assert not open_upstream, f"{len(open_upstream)} upstream requests outlived their clients"


def test_a_client_leaving_mid_stream_cancels_the_upstream_stream():
    streaming = threading.Event()
    ended = threading.Event()

    async def endless(scope, receive, send):
        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            ended.set()  # the proxy closed its upstream connection
        watcher = asyncio.ensure_future(watch())
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(600):  # 60 s at most
            if ended.is_set():
                break
            await send({"type": "http.response.body", "body": EVENT, "more_body": True})
            streaming.set()
            await asyncio.sleep(0.1)
        watcher.cancel()

    with running(upstream({"*": endless})) as (up,), running(Proxy(up.url, port=0).start()) as (proxy,):
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", json={**ASK, "stream": True}) as r:
            next(r.iter_raw())
        assert streaming.is_set()
        assert ended.wait(5), "the upstream kept streaming to a client that had left"


def test_a_full_pool_answers_503_at_once_rather_than_queueing_for_ever():
    async def silent(scope, receive, send):
        while (await receive())["type"] != "http.disconnect":
            pass

    small = Limits(upstream_connections=2, connect_timeout=1)
    with running(upstream({"/v1/chat/completions": silent, "/v1/models": models})) as (up,), \
            running(Proxy(up.url + "/v1", port=0, limits=small).start()) as (proxy,):
        async def two_waiting_and_one_more():
            async with httpx.AsyncClient(timeout=10) as c:
                waiting = [asyncio.ensure_future(c.post(proxy.url + "/v1/chat/completions", json=ASK))
                           for _ in range(2)]
                await asyncio.sleep(0.5)  # both hold an upstream connection now
                start = time.monotonic()
                r = await c.get(proxy.url + "/v1/models")
                took = time.monotonic() - start
                for w in waiting:
                    w.cancel()
                return r, took
        r, took = asyncio.run(two_waiting_and_one_more())
        assert r.status_code == 503 and took < 4
        error = r.json()["error"]
        assert error["code"] == "upstream_busy" and "--upstream-connections" in error["message"]
        assert httpx.get(proxy.url + "/v1/models", timeout=5).status_code == 200  # the clients left: free


def test_timeouts_answer_504_and_an_unreachable_upstream_502_typed_as_upstream_errors(tmp_path):
    async def silent(scope, receive, send):
        while (await receive())["type"] != "http.disconnect":
            pass

    async def trickle(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(300):
            await send({"type": "http.response.body", "body": EVENT, "more_body": True})
            await asyncio.sleep(0.2)

    record = tmp_path / "t.jsonl"
    with running(upstream({"/v1/chat/completions": silent, "/v1/completions": trickle})) as (up,), \
            running(Proxy(up.url, port=0, record=str(record),
                          limits=Limits(read_timeout=1, total_timeout=2)).start()) as (proxy,):
        start = time.monotonic()
        r = httpx.post(proxy.url + "/v1/chat/completions", json=ASK, timeout=10)
        assert r.status_code == 504 and time.monotonic() - start < 5
        error = r.json()["error"]
        assert error["type"] == "upstream_error" and error["code"] == "upstream_timeout"
        assert "--read-timeout" in error["message"]

        start = time.monotonic()  # the total timeout ends a stream that never ends with an error event
        with httpx.stream("POST", proxy.url + "/v1/completions", json={"model": "m", "prompt": "x"},
                          timeout=10) as r:
            events = b"".join(r.iter_raw()).split(b"\n\n")
        assert time.monotonic() - start < 6
        last = json.loads(events[-2].removeprefix(b"data: "))
        assert last["error"]["type"] == "upstream_error" and "--total-timeout" in last["error"]["message"]
        assert [strict(line)["status"] for line in record.read_text().splitlines()] == [504, 200]

    dead = HttpThread(lambda *a: None, "127.0.0.1", 0)
    url = dead.url
    dead.sock.close()
    with running(Proxy(url, port=0).start()) as (proxy,):
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(**ASK)
        assert caught.value.status_code == 502
        assert caught.value.body["type"] == "upstream_error" and "cannot be reached" in caught.value.message


# --- 3. bounded decompression, linear SSE, body and answer limits (the proxy's own memory) ----------

@pytest.mark.parametrize("content_type", [b"application/json", b"text/event-stream"])
def test_a_gzip_bomb_passes_as_it_is_without_the_proxy_inflating_it_or_stalling_others(content_type):
    bomb = gzip_bomb(1024)  # 1 MB that expands to 1 GiB

    async def bombing(scope, receive, send):
        await answer(send, 200, bomb, content_type, headers=[(b"content-encoding", b"gzip")])

    with running(upstream({"/v1/chat/completions": bombing, "/v1/models": models})) as (up,), \
            proxy_process(up.url + "/v1") as (url, pid):
        assert httpx.get(url + "/v1/models").status_code == 200
        before = peak_rss(pid)
        got: list[bytes] = []

        def fetch():
            for _ in range(3):
                with httpx.stream("POST", url + "/v1/chat/completions", json=ASK, timeout=60) as r:
                    got.append(b"".join(r.iter_raw()))
        bombs = threading.Thread(target=fetch)
        bombs.start()
        slowest = 0.0
        while bombs.is_alive():
            start = time.monotonic()
            assert httpx.get(url + "/v1/models", timeout=30).status_code == 200
            slowest = max(slowest, time.monotonic() - start)
        bombs.join()
        assert got == [bomb] * 3  # the client gets the upstream's bytes as they are
        assert peak_rss(pid) - before < 64 * MiB, f"the proxy grew {(peak_rss(pid) - before) / MiB:.0f} MiB"
        assert slowest < 2, f"another client waited {slowest:.1f} s"


def test_a_40_mb_event_stream_line_is_relayed_in_linear_time_and_bounded_memory(tmp_path):
    first = b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n\n'
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 2048, "completion_tokens": 1}}\n\n'

    async def giant_line(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": first, "more_body": True})
        for _ in range(40):
            await send({"type": "http.response.body", "body": b"x" * MiB, "more_body": True})
        await send({"type": "http.response.body", "body": b"\n\n" + usage + b"data: [DONE]\n\n"})

    record = tmp_path / "t.jsonl"
    with running(upstream({"/v1/chat/completions": giant_line, "/v1/models": models})) as (up,), \
            proxy_process(up.url + "/v1", "--record", str(record)) as (url, pid):
        assert httpx.get(url + "/v1/models").status_code == 200
        before = peak_rss(pid)
        start = time.monotonic()
        with httpx.stream("POST", url + "/v1/chat/completions", json={**ASK, "stream": True},
                          timeout=60) as r:
            size = sum(len(chunk) for chunk in r.iter_raw())
        took = time.monotonic() - start
        assert size == len(first) + 40 * MiB + 2 + len(usage) + len(b"data: [DONE]\n\n")
        assert took < 8, f"40 MB without a newline took {took:.1f} s"
        assert peak_rss(pid) - before < 32 * MiB
        rec = strict(record.read_text())
        assert rec["usage"]["prompt_tokens"] == 2048  # read from the line after the giant one


def test_a_300_mb_client_body_is_refused_413_and_never_held():
    reached = []

    async def counted(scope, receive, send):
        reached.append(scope["path"])
        await chat(scope, receive, send)

    opening = b'{"model": "m", "messages": [{"role": "user", "content": "'

    def body():
        yield opening
        for _ in range(300):
            yield b"x" * MiB

    with running(upstream({"*": counted})) as (up,), \
            proxy_process(up.url + "/v1", "--max-body-bytes", str(MiB)) as (url, pid):
        before = peak_rss(pid)
        declared = len(opening) + 300 * MiB
        try:
            r = httpx.post(url + "/v1/chat/completions", content=body(), timeout=60,
                           headers={"content-type": "application/json", "content-length": str(declared)})
            assert r.status_code == 413
            assert r.json()["error"]["type"] == "invalid_request_error" and "--max-body-bytes" in r.text
        except httpx.TransportError:
            pass  # past what it drains, the proxy closes the connection instead (serve's guard does alike)
        assert reached == []
        assert peak_rss(pid) - before < 32 * MiB
        assert httpx.post(url + "/v1/chat/completions", json=ASK).status_code == 200  # still serving


def test_a_large_answer_is_held_once_and_one_over_the_limit_is_a_502():
    async def embeddings(scope, receive, send):
        size = int(scope["query_string"].decode().split("=")[1])
        headers = [(b"content-type", b"application/json"), (b"content-length", str(size).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for at in range(0, size, MiB):
            await send({"type": "http.response.body", "body": b" " * min(MiB, size - at), "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    with running(upstream({"/v1/embeddings": embeddings, "/v1/models": models})) as (up,), \
            proxy_process(up.url + "/v1", "--max-answer-bytes", str(56 * MiB)) as (url, pid):
        assert httpx.get(url + "/v1/models").status_code == 200
        before = peak_rss(pid)
        r = httpx.post(url + f"/v1/embeddings?size={48 * MiB}", json={"model": "m", "input": "x"}, timeout=60)
        assert r.status_code == 200 and len(r.content) == 48 * MiB
        grown = peak_rss(pid) - before
        assert grown < 1.5 * 48 * MiB, f"a 48 MiB answer took {grown / MiB:.0f} MiB"
        r = httpx.post(url + f"/v1/embeddings?size={200 * MiB}", json={"model": "m", "input": "x"},
                       timeout=60)
        assert r.status_code == 502
        error = r.json()["error"]
        assert error["type"] == "upstream_error" and "--max-answer-bytes" in error["message"]
        assert peak_rss(pid) - before < 1.5 * 56 * MiB


# --- 4. serve's guard, the base path, secrets, the recording's file ---------------------------------

def test_a_web_page_cannot_reach_the_upstream_through_the_proxy():
    reached = []

    async def counted(scope, receive, send):
        reached.append(scope["path"])
        await chat(scope, receive, send)

    with running(upstream({"*": counted})) as (up,), \
            running(Proxy(up.url + "/v1", port=0).start()) as (proxy,):
        r = httpx.post(proxy.url + "/v1/chat/completions", content=json.dumps(ASK),
                       headers={"content-type": "text/plain"})  # a form post needs no CORS preflight
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        r = httpx.post(proxy.url + "/v1/chat/completions", json=ASK,
                       headers={"host": "attacker.example"})  # DNS rebinding
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
        assert reached == []
        assert httpx.post(proxy.url + "/v1/chat/completions", json=ASK).status_code == 200
    with running(upstream({"*": counted})) as (up,), \
            running(Proxy(up.url + "/v1", port=0, allowed_hosts=["proxy.lan"]).start()) as (proxy,):
        assert httpx.post(proxy.url + "/v1/chat/completions", json=ASK,
                          headers={"host": "proxy.lan"}).status_code == 200


def test_paths_stay_under_the_upstreams_base():
    seen = []

    async def anything(scope, receive, send):
        seen.append(scope["path"])
        await models(scope, receive, send)

    with running(upstream({"*": anything})) as (up,), \
            running(Proxy(up.url + "/api/v1", port=0).start()) as (proxy,):
        def get(path: str) -> http.client.HTTPResponse:
            conn = http.client.HTTPConnection("127.0.0.1", proxy.http.port, timeout=10)
            conn.request("GET", path)  # sent as written: no client-side normalising
            resp = conn.getresponse()
            resp.read()
            conn.close()
            return resp
        for escaping in ("/v1/../../x", "/v1/%2e%2e/%2e%2e/x", "/v1/models/../../../../etc/passwd", "/.."):
            assert get(escaping).status == 400, escaping
        assert get("/v1/models/../models").status == 200
        assert get("/v1/./models").status == 200
        assert seen == ["/api/v1/models", "/api/v1/models"]


def test_an_upstream_echoing_the_key_in_a_5xx_never_puts_it_on_disk(tmp_path):
    async def echo(scope, receive, send):
        keys_first = sorted(scope["headers"], key=lambda kv: kv[0] not in (b"authorization", b"x-api-key",
                                                                          b"api-key"))  # within 200 chars
        text = "\n".join(f"{k.decode()}: {v.decode()}" for k, v in keys_first)
        await answer(send, 500, f"upstream crashed; you sent\n{text}".encode(), b"text/plain")

    record = tmp_path / "trace.jsonl"
    with running(upstream({"*": echo})) as (up,), \
            running(Proxy(up.url + "/v1", port=0, record=str(record)).start()) as (proxy,):
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.InternalServerError) as caught:
            client.chat.completions.create(**{**ASK, "user": KEY})
        assert caught.value.body["type"] == "upstream_error"
        assert KEY not in caught.value.message and "[redacted]" in caught.value.message
        r = httpx.post(proxy.url + "/v1/completions", json={"model": "m", "prompt": "x"},
                       headers={"x-api-key": OTHER_KEY, "api-key": OTHER_KEY})
        assert r.status_code == 500 and OTHER_KEY not in r.text
        httpx.post(proxy.url + "/v1/chat/completions", json=ASK, headers={"authorization": f"Bearer {KEY}"})
    lines = [strict(line) for line in record.read_text().splitlines()]
    assert len(lines) == 3 and all("answered 500" in rec["error"] for rec in lines)
    assert lines[0]["body"]["user"] == "[redacted]"
    for folder, _, files in os.walk(tmp_path):
        for name in files:
            with open(os.path.join(folder, name), "rb") as fh:
                data = fh.read()
            assert KEY.encode() not in data and OTHER_KEY.encode() not in data, name
            assert b"Bearer sk-" not in data and not re.search(rb"sk-[A-Za-z0-9_-]{8,}", data), name


def test_the_recording_is_private_capped_rotated_and_strict_json(tmp_path):
    async def weird_usage(scope, receive, send):
        await answer(send, 200, b'{"choices": [], "usage": {"prompt_tokens": NaN, "completion_tokens": '
                                b'Infinity, "total_tokens": -Infinity, "cost": 1e400}}')

    record = tmp_path / "trace.jsonl"
    record.write_text("")
    os.chmod(record, 0o644)  # a file left there before is made private too
    with running(upstream({"*": weird_usage})) as (up,), \
            running(Proxy(up.url + "/v1", port=0, record=str(record),
                          record_max_bytes=4000).start()) as (proxy,):
        raw = b'{"model": "m", "temperature": NaN, "top_p": 1e999, "messages": [{"role": "user", ' \
              b'"content": "' + b"y" * 500 + b'"}]}'
        for _ in range(12):
            r = httpx.post(proxy.url + "/v1/chat/completions", content=raw,
                           headers={"content-type": "application/json"})
            assert r.status_code == 200
    rotated = tmp_path / "trace.jsonl.1"
    for path in (record, rotated):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert 0 < path.stat().st_size <= 4000
        for line in path.read_text().splitlines():
            rec = strict(line)
            assert rec["body"]["temperature"] is None and rec["body"]["top_p"] is None
            assert rec["usage"] == {"prompt_tokens": None, "completion_tokens": None, "total_tokens": None,
                                    "cost": None}


def test_proxy_limits_are_checked(tmp_path):
    from app.cli import main
    for flag, value in [("--read-timeout", "0"), ("--connect-timeout", "nan"), ("--total-timeout", "inf"),
                        ("--max-body-bytes", "-1"), ("--upstream-connections", "0"),
                        ("--max-line-bytes", "0")]:
        with pytest.raises(SystemExit, match=f"{flag} must be a number > 0, got"):
            main(["proxy", "--upstream", "http://127.0.0.1:9", flag, value])
    with pytest.raises(SystemExit, match="--record-max-bytes must be >= 1"):
        main(["proxy", "--upstream", "http://127.0.0.1:9", "--record", str(tmp_path / "t.jsonl"),
              "--record-max-bytes", "0"])
    with pytest.raises(SystemExit, match=r"prefixlab proxy: --max-connections must be from 1 to \d+ .*got 0"):
        main(["proxy", "--upstream", "http://127.0.0.1:9", "--port", "0", "--max-connections", "0"])
    with pytest.raises(SystemExit, match=r"prefixlab proxy: --idle-timeout must be in \(0, 3600\]"):
        main(["proxy", "--upstream", "http://127.0.0.1:9", "--port", "0", "--idle-timeout", "0"])


# --- the proxy's own connections, bounded as serve's are ----------------------------------------------

def _closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(0)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_idle_connections_over_the_proxys_limit_leave_it_answering_and_log_one_line(caplog):
    """200 sockets that never send a request against a limit of 20: the oldest idle ones make
    room, a real request is answered at once, and the burst is one log line naming the proxy."""
    with running(upstream({"/v1/models": models, "/v1/chat/completions": chat})) as (up,), \
            caplog.at_level("WARNING"), \
            running(Proxy(up.url + "/v1", port=0, max_connections=20, idle_timeout_s=30).start()) as (proxy,):
        socks = [socket.create_connection(("127.0.0.1", proxy.http.port), timeout=10) for _ in range(200)]
        try:
            start = time.monotonic()
            r = httpx.post(proxy.url + "/v1/chat/completions", json=ASK, timeout=10)
            assert r.status_code == 200 and r.json() == ANSWER and time.monotonic() - start < 2
            deadline = time.monotonic() + 10
            while not any("connection limit" in m for m in caplog.messages) and time.monotonic() < deadline:
                time.sleep(0.05)
            still_open = [s for s in socks if not _closed_by_peer(s)]
        finally:
            for s in socks:
                s.close()
    lines = [m for m in caplog.messages if "connection limit" in m]
    assert len(lines) == 1, lines
    assert lines[0].startswith("prefixlab proxy: at the connection limit of 20 (--max-connections)"), lines[0]
    assert len(still_open) <= 20  # the newest held on; the rest were closed to stay under the limit


def test_with_every_connection_running_a_request_a_newcomer_gets_503_and_an_idle_one_is_closed():
    async def silent(scope, receive, send):
        while (await receive())["type"] != "http.disconnect":
            pass

    with running(upstream({"/v1/chat/completions": silent, "/v1/models": models})) as (up,), \
            running(Proxy(up.url + "/v1", port=0, max_connections=2, idle_timeout_s=0.5).start()) as (proxy,):
        with socket.create_connection(("127.0.0.1", proxy.http.port), timeout=10) as idle:
            idle.settimeout(5)
            start = time.monotonic()
            assert idle.recv(1) == b""  # it asked nothing: closed after --idle-timeout
            assert 0.4 < time.monotonic() - start < 3

        async def two_running_and_one_more():
            async with httpx.AsyncClient(timeout=10) as c:
                running_ = [asyncio.ensure_future(c.post(proxy.url + "/v1/chat/completions", json=ASK))
                            for _ in range(2)]
                await asyncio.sleep(0.5)  # both connections run a request now
                async with httpx.AsyncClient(timeout=10) as newcomer:
                    r = await newcomer.get(proxy.url + "/v1/models")
                for w in running_:
                    w.cancel()
                return r
        r = asyncio.run(two_running_and_one_more())
        assert r.status_code == 503
        error = r.json()["error"]
        assert error["code"] == "server_busy" and "--max-connections" in error["message"]
        assert httpx.get(proxy.url + "/v1/models", timeout=5).status_code == 200  # they left: room again


# --- fuzz: whatever the upstream answers -------------------------------------------------------------

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
_sse = st.sampled_from([b"data: ", b"data:", b"\n", b"\n\n", b"\r\n", b"[DONE]", b": ping\n\n",
                        b"event: x\n", b'{"usage": {"prompt_tokens": 7}}',
                        b'{"usage": {"note": "Bearer ' + KEY.encode() + b'"}}',
                        b'{"timings": {"cache_n": NaN}}', b"Infinity", b"\xff\xfe", b'{"usage": [[[[[[',
                        b"}"])
_json = st.sampled_from([json.dumps(ANSWER).encode(), b'{"error": {"message": "no"}}',
                         b'{"error": "' + KEY.encode() + b'"}', b'{"usage": {"k": "' + KEY.encode() + b'"}}',
                         b"authorization: Bearer " + KEY.encode(), b"[" * 5000, b"NaN", b""])
answers = st.fixed_dictionaries({
    "status": st.sampled_from([200, 200, 400, 429, 500, 502, 503]),
    "type": st.sampled_from([b"application/json", b"text/event-stream", b"text/plain", b""]),
    "encoding": st.sampled_from([b"", b"gzip", b"deflate", b"br", b"identity"]),
    "compress": st.booleans(),  # whether the bytes really are compressed as the header says
    "parts": st.lists(st.binary(max_size=64) | _sse | _json, max_size=8),
    "chunk": st.integers(1, 512),
    "length": st.booleans(),  # a Content-Length, or chunked
    "cut": st.booleans(),  # the upstream dies before the end
})


@pytest.fixture(scope="module")
def fuzz_rig(tmp_path_factory):
    current: dict = {}

    async def fuzzed(scope, receive, send):
        a = current["answer"]
        data = b"".join(a["parts"])
        if a["compress"] and a["encoding"] in (b"gzip", b"deflate"):
            data = gzip.compress(data) if a["encoding"] == b"gzip" else zlib.compress(data)
        headers = [(b"content-type", a["type"])] if a["type"] else []
        headers += [(b"content-encoding", a["encoding"])] if a["encoding"] else []
        headers += [(b"content-length", str(len(data)).encode())] if a["length"] and not a["cut"] else []
        await send({"type": "http.response.start", "status": a["status"], "headers": headers})
        for at in range(0, len(data), a["chunk"]):
            await send({"type": "http.response.body", "body": data[at:at + a["chunk"]], "more_body": True})
        if a["cut"]:
            raise ConnectionAbortedError("the fuzzed upstream dies mid-answer")
        await send({"type": "http.response.body", "body": b""})

    record = tmp_path_factory.mktemp("fuzz") / "trace.jsonl"
    up = upstream({"/v1/models": models, "*": fuzzed})
    proxy = Proxy(up.url + "/v1", port=0, record=str(record), limits=Limits(read_timeout=5)).start()
    yield proxy, current, record
    proxy.stop()
    up.stop()


@FUZZ
@given(a=answers, stream=st.booleans())
def test_fuzz_upstream_answers_get_a_well_formed_answer_and_never_record_a_secret(fuzz_rig, a, stream):
    proxy, current, record = fuzz_rig
    current["answer"] = a
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json={**ASK, "stream": stream, "user": KEY},
                      headers={"authorization": f"Bearer {KEY}"}, timeout=30) as r:
        body = b"".join(r.iter_raw())  # as sent: a well-formed HTTP answer, whatever it holds
    streamed = a["type"] == b"text/event-stream"
    if a["cut"] and streamed:
        assert r.status_code == a["status"]
        assert strict(body.rstrip(b"\n").rsplit(b"\n\n", 1)[-1].removeprefix(b"data: ").decode())["error"][
            "type"] == "upstream_error"
    elif a["cut"]:
        assert r.status_code == 502 and strict(body.decode())["error"]["type"] == "upstream_error"
    elif not streamed and a["status"] >= 500 and a["encoding"] in (b"", b"identity"):
        error = json.loads(body)["error"]
        assert isinstance(error, (dict, str))  # the upstream's own error object, or the proxy's
    else:
        assert r.status_code == a["status"]
    assert httpx.get(proxy.url + "/v1/models").status_code == 200  # still serving
    text = record.read_text(encoding="utf-8")
    assert KEY not in text and "Bearer sk-" not in text
    for line in text.splitlines():
        strict(line)
