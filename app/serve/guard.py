"""What every request passes before FastAPI sees it: a Host allow-list, JSON bodies only, a size limit.

A keyless server on 127.0.0.1 is reachable from any web page a person visits: a
`text/plain` form post needs no CORS preflight, and DNS rebinding sends a foreign
`Host`. So, as llama.cpp and Ollama do: bodies must be JSON (415), the Host header
must name this machine (400), and a body over the limit is answered 413 without
being kept. Answers are OpenAI error objects (docs/design.md §8).
"""

from __future__ import annotations

import json
import logging
import socket

from .protocol import error_body

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# An over-long body is read and dropped up to this much, so the client gets its 413 rather
# than a reset connection mid-upload; past it the connection is closed.
DRAIN_LIMIT_BYTES = 256 * 1024 * 1024
WILDCARD_HOSTS = {"0.0.0.0", "::", ""}
log = logging.getLogger("prefixlab.serve")


def local_hosts(bind_host: str, extra: list[str] | None = None) -> set[str] | None:
    """The Host names this server answers: this machine's names, the bound address, `extra`;
    None (any host) when `extra` holds "*"."""
    extra = [h.strip().lower() for h in extra or [] if h.strip()]
    if "*" in extra:
        return None
    names = {"localhost", "127.0.0.1", "::1", bind_host.lower()} | set(extra)
    if bind_host in WILDCARD_HOSTS:  # listening on every interface: this machine's own names too
        for name in {socket.gethostname(), socket.getfqdn()}:
            names.add(name.lower())
            try:
                names.update(socket.gethostbyname_ex(name)[2])
            except OSError:
                pass
    return names - WILDCARD_HOSTS


def host_name(header: str) -> str:
    """The name part of a Host header: `[::1]:8000` -> `::1`, `Example.com:80` -> `example.com`."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


async def send_error(send, status: int, message: str, code: str, param: str | None = None) -> None:
    """An OpenAI error object as a whole ASGI response."""
    body = json.dumps(error_body(status, message, param, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _is_json(content_type: str) -> bool:
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


class Guard:
    """ASGI middleware: Host allow-list (None: any), JSON-only POST bodies, `max_body_bytes`."""

    def __init__(self, app, allowed_hosts: set[str] | None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app, self.allowed_hosts, self.max_body_bytes = app, allowed_hosts, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = host_name(headers.get("host", ""))
        if self.allowed_hosts is not None and host not in self.allowed_hosts:
            return await send_error(send, 400, f"Host {host!r} is not allowed: this server answers "
                                    f"{', '.join(sorted(self.allowed_hosts))} (widen with --allowed-hosts)",
                                    "invalid_host")
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        if not _is_json(headers.get("content-type", "")):
            given = headers.get("content-type") or "none"
            return await send_error(send, 415, "the body must be JSON: send 'Content-Type: "
                                    f"application/json' (got {given[:80]!r})", "unsupported_media_type")
        body = await self._read(scope, receive, headers, send)
        if body is None:
            return None
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the disconnect, as uvicorn's own do

        return await self.app(scope, replay, send)

    async def _read(self, scope, receive, headers: dict, send) -> bytes | None:
        """The whole body, or None once a 413 went out (an over-long body is dropped as it comes)."""
        limit = self.max_body_bytes
        declared = headers.get("content-length", "")
        over = declared.isdigit() and int(declared) > limit
        chunks, size, more = [], 0, True
        while more and size <= DRAIN_LIMIT_BYTES:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            piece = message.get("body", b"")
            size += len(piece)
            more = message.get("more_body", False)
            over = over or size > limit
            if not over:
                chunks.append(piece)
            elif chunks:
                chunks = []  # keep nothing of a body that is refused
        if over:
            log.warning("prefixlab serve: refused a %s-byte body on %s (limit %d; --max-body-bytes)",
                        declared or f"{size}+", scope.get("path", "?"), limit)
            await send_error(send, 413, f"the request body is larger than this server's limit of {limit} "
                             f"bytes (--max-body-bytes)", "request_too_large")
            return None
        return b"".join(chunks)
