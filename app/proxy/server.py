"""The recording proxy's ASGI app: every request forwarded under the upstream's base (docs/design.md §14).

Bodies and headers pass as they are (hop-by-hop headers aside); the answer streams back
byte for byte. First, serve's own guard: the Host must name this machine, a body must be
JSON and within its limit, so a web page cannot reach a keyless server through the proxy.
Every exchange is bounded (`Limits`): connect, read and total timeouts, a pool of upstream
connections, the size of an answer held whole, what is decoded to read usage (inflated
off the event loop, so a compressed answer never stalls the other clients); a client
that goes away cancels its upstream request, so a silent upstream cannot hold the pool.
An upstream that cannot be reached, times out, answers a 5xx without an error object or
closes mid-answer gives the client an OpenAI error object typed `upstream_error`; the proxy
keeps serving.
"""

from __future__ import annotations

import json
from urllib.parse import quote

import anyio
import httpx

from ..serve.guard import Guard, local_hosts
from ..serve.protocol import error_body
from .limits import Limits
from .record import (
    Recorder,
    UsageReader,
    now,
    redact,
    secrets_in,
)

HOP_BY_HOP = {"host", "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
              "trailer", "transfer-encoding", "upgrade", "content-length"}
RECORDED = ("/chat/completions", "/completions", "/messages")  # /messages: Anthropic's Messages API
SEND_SLICE = 1 << 20  # a held answer goes out this much at a time: no second copy of it
ERROR_OBJECT_BYTES = 1 << 20  # a 5xx body past this is not parsed to see whether it is an error object
PATH_SAFE = "/!$&'()*+,;=:@"  # kept as they are when the resolved path is quoted again


def upstream_url(upstream: str, path: str, query: str) -> str:
    """Where a request goes: the upstream plus the path with its dot segments resolved (one /v1
    when both have it); a ValueError for a path that climbs above the root."""
    segments: list[str] = []
    for segment in path.split("/")[1:]:
        if segment == "..":
            if not segments:
                raise ValueError(f"the path {path[:200]!r} climbs above the API's root")
            segments.pop()
        elif segment != ".":
            segments.append(segment)
    path = "/" + "/".join(segments)
    base = upstream.rstrip("/")
    if base.endswith("/v1") and (path == "/v1" or path.startswith("/v1/")):
        path = path[3:]
    return base + quote(path, safe=PATH_SAFE) + (f"?{query}" if query else "")


def error_json(status: int, message: str, code: str) -> bytes:
    """An OpenAI error object; one the proxy makes for a failed upstream (5xx) is typed `upstream_error`."""
    body = error_body(status, message, None, code)
    if status >= 500:  # serve's table types its own statuses; a gateway's failure is the upstream's
        body["error"]["type"] = "upstream_error"
    return json.dumps(body).encode()


async def send_json_error(send, status: int, message: str, code: str) -> None:
    body = error_json(status, message, code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _declared(headers) -> int:
    """The answer's Content-Length as sent (0 when absent or not a number)."""
    value = headers.get("content-length", "")
    return int(value) if value.isdigit() else 0


def create_proxy_app(upstream: str, recorder: Recorder, limits: Limits | None = None,
                     host: str = "127.0.0.1", allowed_hosts: list[str] | None = None):
    """The proxy's app behind serve's guard: forwards any path and method to `upstream`, records
    completions."""
    limits = limits or Limits()
    app = ProxyApp(upstream, recorder, limits)
    return Guard(app, local_hosts(host, allowed_hosts), limits.max_body_bytes)


class _Exchange:
    """One request's answer as it goes out, and what is recorded of it."""

    def __init__(self, send, secrets: list[str], record):
        self._send, self.secrets, self._record = send, secrets, record
        self.status: int | None = None
        self.error = ""
        self.usage: UsageReader | None = None
        self.started = self.streaming = self.done = self.client_gone = False
        self.first_byte: float | None = None  # when the upstream's answer began (its first body byte)
        self.whole: tuple[int, list, list[bytes]] | None = None  # held, sent once the upstream is done

    async def start(self, status: int, headers: list) -> None:
        self.status, self.started = status, True
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    def record(self) -> None:
        """Record the exchange once, before the client sees its end (a recording read right after
        an answer holds its line)."""
        if self._record is not None:
            self._record, record = None, self._record
            record(self)

    async def body(self, data: bytes, last: bool = False) -> None:
        if last:
            self.done = True
            self.record()
        await self._send({"type": "http.response.body", "body": data, "more_body": not last})

    async def fail(self, status: int, message: str, code: str) -> None:
        """The client learns what went wrong: an error answer, or an error event ending a stream."""
        message = redact(message, self.secrets)
        self.error, self.whole = message, None
        if not self.started:
            self.status, self.started, self.done = status, True, True
            self.record()
            await send_json_error(self._send, status, message, code)
        elif self.streaming and not self.done:  # a blank line first ends whatever the upstream left half-sent
            await self.body(b"\n\ndata: " + error_json(status, message, code) + b"\n\n", last=True)

    async def send_whole(self) -> None:
        status, headers, held = self.whole
        await self.start(status, headers)
        piece: list[bytes] = []
        size = 0
        for chunk in held:  # the chunks as they came, sent a slice at a time: never joined whole
            piece.append(chunk)
            size += len(chunk)
            if size >= SEND_SLICE:
                await self.body(b"".join(piece))
                piece, size = [], 0
        await self.body(b"".join(piece), last=True)


class ProxyApp:
    """The forwarding ASGI app (under `Guard`); one pooled httpx client, made on the server's loop."""

    def __init__(self, upstream: str, recorder: Recorder, limits: Limits):
        self.upstream, self.recorder, self.limits = upstream, recorder, limits
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            lim = self.limits
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(connect=lim.connect_timeout, read=lim.read_timeout,
                                      write=lim.read_timeout, pool=lim.connect_timeout),
                limits=httpx.Limits(max_connections=lim.upstream_connections,
                                    max_keepalive_connections=min(20, lim.upstream_connections)),
                follow_redirects=False)
            self._client.headers.clear()  # only the client's own headers go upstream
        return self._client

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        arrival = now()
        body = await self._read_body(receive, send)
        if body is None:
            return
        try:
            url = upstream_url(self.upstream, scope["path"], scope["query_string"].decode("latin-1"))
        except ValueError as e:
            await send_json_error(send, 400, str(e), "invalid_path")
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        record = None
        if scope["method"] == "POST" and scope["path"].endswith(RECORDED):
            def record(ex: _Exchange) -> None:
                self.recorder.record(arrival, scope["path"], headers, body, ex.status or 499, ex.usage,
                                     ex.error, ex.first_byte)
        ex = _Exchange(send, secrets_in(headers), record)
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(_watch_disconnect, receive, tasks.cancel_scope, ex)
                with anyio.move_on_after(self.limits.total_timeout) as total:
                    await self._exchange(scope, url, body, ex, record is not None)
                if total.cancelled_caught:
                    await ex.fail(504, f"the upstream's answer took over {self.limits.total_timeout:g} s "
                                  "(--total-timeout)", "upstream_timeout")
                tasks.cancel_scope.cancel()
            if ex.client_gone:
                ex.status = ex.status if ex.started else 499  # nginx's "client closed request"
                ex.error = "the client closed the connection before the answer was complete"
            elif ex.whole is not None:  # sent once the upstream is released: a slow reader holds no pool slot
                await ex.send_whole()
        finally:
            ex.record()

    async def _read_body(self, receive, send) -> bytes | None:
        """The request body (the guard bounded JSON ones already; this bounds the others), or None
        once the client went or a 413 went out."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            piece, more = message.get("body", b""), message.get("more_body", False)
            size += len(piece)
            if size > self.limits.max_body_bytes:
                await send_json_error(send, 413, "the request body is larger than the proxy's limit of "
                                      f"{self.limits.max_body_bytes} bytes (--max-body-bytes)",
                                      "request_too_large")
                return None
            chunks.append(piece)
        return b"".join(chunks)

    async def _exchange(self, scope, url: str, body: bytes, ex: _Exchange, recorded: bool) -> None:
        lim = self.limits
        headers = [(k, v) for k, v in scope["headers"] if k.decode("latin-1").lower() not in HOP_BY_HOP]
        client = self.client()
        try:
            request = client.build_request(scope["method"], url, headers=headers, content=body)
            resp = await client.send(request, stream=True)
        except httpx.PoolTimeout:
            return await ex.fail(503, f"all {lim.upstream_connections} connections to the upstream are busy "
                                 "(--upstream-connections)", "upstream_busy")
        except httpx.ConnectTimeout:
            return await ex.fail(504, f"the upstream {self.upstream} did not accept a connection within "
                                 f"{lim.connect_timeout:g} s (--connect-timeout)", "upstream_timeout")
        except httpx.TimeoutException:
            return await ex.fail(504, f"the upstream {self.upstream} did not answer within "
                                 f"{lim.read_timeout:g} s (--read-timeout)", "upstream_timeout")
        except httpx.HTTPError as e:
            return await ex.fail(502, f"the upstream {self.upstream} cannot be reached "
                                 f"({type(e).__name__}: {e})", "upstream_unreachable")
        try:
            out_headers = [(k, v) for k, v in resp.headers.raw
                           if k.decode("latin-1").lower() not in HOP_BY_HOP]
            ex.streaming = resp.headers.get("content-type", "").startswith("text/event-stream")
            if recorded:
                ex.usage = UsageReader(resp.headers.get("content-encoding", ""), ex.streaming,
                                       lim.max_decoded_bytes, lim.max_line_bytes)
            if ex.streaming:
                await ex.start(resp.status_code, out_headers)
            elif _declared(resp.headers) > lim.max_answer_bytes:  # refused before a byte is held
                return await ex.fail(502, "the upstream's answer is larger than the proxy's limit "
                                     f"of {lim.max_answer_bytes} bytes (--max-answer-bytes)",
                                     "answer_too_large")
            held: list[bytes] = []  # the answer's chunks as they came (a growing buffer would copy)
            held_size = 0
            try:
                async for raw in resp.aiter_raw():
                    if ex.first_byte is None:
                        ex.first_byte = now()
                    if ex.usage is not None and ex.usage.inflating:
                        # on a worker thread (zlib lets go of the GIL): a bomb stalls no other client
                        await anyio.to_thread.run_sync(ex.usage.feed, raw)
                    elif ex.usage is not None:
                        ex.usage.feed(raw)
                    if ex.streaming:
                        await ex.body(raw)
                    elif held_size + len(raw) > lim.max_answer_bytes:
                        return await ex.fail(502, "the upstream's answer is larger than the proxy's limit "
                                             f"of {lim.max_answer_bytes} bytes (--max-answer-bytes)",
                                             "answer_too_large")
                    else:
                        held.append(raw)
                        held_size += len(raw)
            except httpx.TimeoutException:
                return await ex.fail(504, f"the upstream sent nothing for {lim.read_timeout:g} s mid-answer "
                                     "(--read-timeout)", "upstream_timeout")
            except httpx.HTTPError as e:
                return await ex.fail(502, "the upstream closed the connection mid-answer "
                                     f"({type(e).__name__})", "upstream_error")
            if ex.usage is not None:
                ex.usage.finish()
            if ex.streaming:
                return await ex.body(b"", last=True)
            if resp.status_code >= 500 and not _is_error_object(resp, held, held_size):
                head = b""
                for chunk in held:  # the first 200 bytes, without joining the whole answer
                    head += chunk[:200]
                    if len(head) >= 200:
                        break
                text = head[:200].decode("utf-8", "replace").strip() or "no body"
                return await ex.fail(resp.status_code, f"the upstream {self.upstream} answered "
                                     f"{resp.status_code}: {text}", "upstream_error")
            if scope["method"] != "HEAD":
                out_headers.append((b"content-length", str(held_size).encode()))
            elif "content-length" in resp.headers:  # the length of the body a HEAD answer does not send
                out_headers.append((b"content-length", resp.headers["content-length"].encode("latin-1")))
            ex.status, ex.whole = resp.status_code, (resp.status_code, out_headers, held)
        finally:
            with anyio.CancelScope(shield=True):  # closed even when cancelled: the pool gets its slot back
                await resp.aclose()


async def _watch_disconnect(receive, scope: anyio.CancelScope, ex: _Exchange) -> None:
    """Cancel the exchange (and so its upstream request) once the client goes away."""
    while (await receive())["type"] != "http.disconnect":
        pass
    if not ex.done:  # uvicorn reports a finished answer as a disconnect too
        ex.client_gone = True
        scope.cancel()


def _is_error_object(resp: httpx.Response, held: list[bytes], size: int) -> bool:
    """An OpenAI error object the client can read as it is."""
    if resp.headers.get("content-encoding", "") not in ("", "identity"):
        return True  # compressed: pass it on untouched
    if size > ERROR_OBJECT_BYTES:
        return False
    try:
        obj = json.loads(b"".join(held))
    except (ValueError, RecursionError):
        return False
    return isinstance(obj, dict) and isinstance(obj.get("error"), (dict, str))
