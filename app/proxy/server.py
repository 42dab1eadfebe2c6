"""The recording proxy's ASGI app: every request forwarded to the upstream unchanged (docs/design.md §14).

Bodies and headers pass as they are (hop-by-hop headers aside); the answer streams back
byte for byte. An upstream that cannot be reached, answers a 5xx without an error object,
or closes mid-answer gives the client an OpenAI error object; the proxy keeps serving.
"""

from __future__ import annotations

import json

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from ..serve.protocol import error_body
from .record import Recorder, UsageReader, now, routing_key

HOP_BY_HOP = {"host", "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
              "trailer", "transfer-encoding", "upgrade", "content-length"}
RECORDED = ("/chat/completions", "/completions")
TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None)  # answers may take minutes


def upstream_url(upstream: str, path: str, query: str) -> str:
    """Where a request goes: the upstream plus the path (one /v1 when both have it)."""
    base = upstream.rstrip("/")
    if base.endswith("/v1") and (path == "/v1" or path.startswith("/v1/")):
        path = path[3:]
    return base + path + (f"?{query}" if query else "")


def _error(message: str, status: int = 502) -> Response:
    """An OpenAI error object about the upstream."""
    return Response(json.dumps(error_body(status, message, None, "upstream_error")), status,
                    media_type="application/json")


def _mid_stream_error(message: str) -> bytes:
    return b"data: " + json.dumps(error_body(502, message, None, "upstream_error")).encode() + b"\n\n"


def create_proxy_app(upstream: str, recorder: Recorder) -> FastAPI:
    """The proxy's app: forwards any path and method to `upstream`, records completions."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    state: dict[str, httpx.AsyncClient] = {}

    def client() -> httpx.AsyncClient:
        if "client" not in state:  # made on the server's own event loop
            c = httpx.AsyncClient(timeout=TIMEOUT, follow_redirects=False)
            c.headers.clear()  # only the client's own headers go upstream
            state["client"] = c
        return state["client"]

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
    async def forward(request: Request, path: str):
        arrival = now()
        body = await request.body()
        url = upstream_url(upstream, request.url.path, request.url.query)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        recorded = request.method == "POST" and request.url.path.endswith(RECORDED)

        def record(status: int, usage: UsageReader | None, error: str = "") -> None:
            if recorded:
                recorder.record(arrival, request.url.path, routing_key(request.headers), body, status,
                                usage, error)

        try:
            upstream_req = client().build_request(request.method, url, headers=headers, content=body)
            resp = await client().send(upstream_req, stream=True)
        except httpx.HTTPError as e:
            message = f"the upstream {upstream} cannot be reached ({type(e).__name__}: {e})"
            record(502, None, message)
            return _error(message)
        out_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers.multi_items()
                       if k.lower() not in HOP_BY_HOP]
        streaming = resp.headers.get("content-type", "").startswith("text/event-stream")
        usage = UsageReader(resp.headers.get("content-encoding", ""), streaming)
        if streaming:
            return _streamed(resp, usage, out_headers, record)
        return await _whole(resp, usage, out_headers, record, upstream)

    return app


def _streamed(resp: httpx.Response, usage: UsageReader, headers: list, record) -> StreamingResponse:
    """Server-Sent Events relayed as they come; a cut upstream ends the stream with an error event."""
    async def relay():
        error = ""
        try:
            async for raw in resp.aiter_raw():
                usage.feed(raw)
                yield raw
        except httpx.HTTPError as e:
            error = f"the upstream closed the connection mid-answer ({type(e).__name__})"
            yield _mid_stream_error(error)
        finally:
            await resp.aclose()
            usage.finish()
            record(resp.status_code, usage, error)
    out = StreamingResponse(relay(), status_code=resp.status_code)
    out.raw_headers = headers
    return out


async def _whole(resp: httpx.Response, usage: UsageReader, headers: list, record, upstream: str) -> Response:
    """A whole answer, read before answering so a cut upstream becomes a clear 502, not half a body."""
    try:
        raw = b"".join([chunk async for chunk in resp.aiter_raw()])
    except httpx.HTTPError as e:
        message = f"the upstream closed the connection mid-answer ({type(e).__name__})"
        record(502, None, message)
        return _error(message)
    finally:
        await resp.aclose()
    usage.feed(raw)
    usage.finish()
    if resp.status_code >= 500 and not _is_error_object(resp, raw):
        text = raw[:200].decode("utf-8", "replace").strip() or "no body"
        message = f"the upstream {upstream} answered {resp.status_code}: {text}"
        record(resp.status_code, usage, message)
        return _error(message, resp.status_code)
    record(resp.status_code, usage)
    out = Response(raw, status_code=resp.status_code)
    out.raw_headers = headers + [(b"content-length", str(len(raw)).encode())]
    return out


def _is_error_object(resp: httpx.Response, raw: bytes) -> bool:
    """An OpenAI error object the client can read as it is."""
    if resp.headers.get("content-encoding", "") not in ("", "identity"):
        return True  # compressed: pass it on untouched
    try:
        obj = json.loads(raw)
    except ValueError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("error"), (dict, str))
