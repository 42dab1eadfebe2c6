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


# --- connections ----------------------------------------------------------------------------------
# Every open connection costs a file descriptor; tens of thousands of idle ones (opened and
# never used) exhaust the process's, and then every accept fails and asyncio logs each failure.
# So connections are counted below the descriptor limit, a connection that sends no request
# is closed after a while, and at the limit the longest-idle one makes room for the newcomer
# (only connections with a request running are kept for sure).
DEFAULT_MAX_CONNECTIONS = 1000
DEFAULT_IDLE_TIMEOUT_S = 15.0
MAX_IDLE_TIMEOUT_S = 3600.0
FD_RESERVE = 64  # descriptors left for the model file, logs, the KV-event sockets and the like
BURST_QUIET_S = 1.0  # a burst of connections over the limit ends after this long without one
BURST_MAX_S = 60.0   # ... or is reported every minute while it lasts


def descriptor_limit() -> int:
    """The number of files this process may have open (its soft RLIMIT_NOFILE)."""
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def default_max_connections() -> int:
    return max(1, min(DEFAULT_MAX_CONNECTIONS, descriptor_limit() - FD_RESERVE))


def add_connection_args(p) -> None:
    """`--max-connections` and `--idle-timeout`, for serve and the proxy alike."""
    p.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="open connections at most; at the limit the longest-idle one is closed for a "
                        "newcomer, and with every one running a request the newcomer gets 503 (default: "
                        f"{default_max_connections()}, under this process's file limit)")
    p.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE_TIMEOUT_S, metavar="S",
                   help="close a connection that has sent no request for S seconds (default %(default)s)")


def check_connection_options(max_connections: int, idle_timeout_s: float) -> None:
    """ValueError naming the option that is out of its range."""
    room = descriptor_limit() - FD_RESERVE
    if not 1 <= max_connections <= room:
        raise ValueError(f"--max-connections must be from 1 to {room} (this process may open "
                         f"{room + FD_RESERVE} files; raise it with ulimit -n), got {max_connections}")
    if not 0 < idle_timeout_s <= MAX_IDLE_TIMEOUT_S:  # also false for NaN
        raise ValueError(f"--idle-timeout must be in (0, {MAX_IDLE_TIMEOUT_S:g}] seconds, "
                         f"got {idle_timeout_s:g}")


class ConnectionLimit:
    """Shared by every connection of a server: the limit, the idle connections (oldest first),
    and the running burst of connections that met the limit (logged once when it ends, as
    `prefixlab <command>`)."""

    def __init__(self, max_connections: int | None = None, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                 command: str = "serve"):
        self.max_connections = default_max_connections() if max_connections is None else max_connections
        self.idle_timeout_s, self.command = idle_timeout_s, command
        check_connection_options(self.max_connections, idle_timeout_s)
        self.idle: dict = {}  # protocol -> None, insertion order: the longest idle first
        self.closed = self.refused = 0    # this burst's
        self._burst: tuple[float, float] | None = None  # (first, latest) loop times

    def make_room(self, loop) -> bool:
        """At the limit: close the longest-idle connection for a newcomer (True), or, when every
        connection runs a request, refuse the newcomer (False). Either joins the burst's count."""
        self._note_burst(loop)
        if self.idle:
            oldest = next(iter(self.idle))
            oldest.close_idle()
            self.closed += 1
            return True
        self.refused += 1
        return False

    def _note_burst(self, loop) -> None:
        """A connection met the limit: one log line when the burst of them ends."""
        now = loop.time()
        if self._burst is None:
            loop.call_later(BURST_QUIET_S, self._end_burst, loop)
            self._burst = (now, now)
        else:
            self._burst = (self._burst[0], now)

    def _end_burst(self, loop) -> None:
        first, latest = self._burst
        now = loop.time()
        if now - latest < BURST_QUIET_S and now - first < BURST_MAX_S:
            loop.call_later(BURST_QUIET_S - (now - latest), self._end_burst, loop)
            return
        log.warning("prefixlab %s: at the connection limit of %d (--max-connections) for %.1f s: "
                    "closed %d idle connection(s) for newer ones, refused %d with 503 (when every one had "
                    "a request running)", self.command, self.max_connections, latest - first, self.closed,
                    self.refused)
        self.closed = self.refused = 0
        self._burst = None


def limited(protocol: type, limit: ConnectionLimit) -> type:
    """`protocol` (uvicorn's H11Protocol or a subclass) under `limit`: counted connections, an idle
    timeout until each request's head arrives, room made at the limit."""

    class Limited(protocol):
        _refused = False
        _idle_timer = None

        def connection_made(self, transport) -> None:
            if len(self.connections) >= limit.max_connections and not limit.make_room(self.loop):
                self._refused = True
                transport.write(_busy_response(limit.max_connections))
                transport.close()
                return
            super().connection_made(transport)
            self._idle()

        def connection_lost(self, exc) -> None:
            if self._refused:
                return
            self._busy()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._busy()  # a request runs: no idle clock, never closed to make room

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._idle()

        def _idle(self) -> None:
            self._busy()
            limit.idle[self] = None
            self._idle_timer = self.loop.call_later(limit.idle_timeout_s, self.close_idle)

        def _busy(self) -> None:
            limit.idle.pop(self, None)
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None

        def close_idle(self) -> None:
            """Close a connection that has no request running (quietly: it asked nothing)."""
            self._busy()
            if not self.transport.is_closing():
                self.transport.close()

    Limited.__name__ = Limited.__qualname__ = f"Limited{protocol.__name__}"
    return Limited


def _busy_response(max_connections: int) -> bytes:
    body = json.dumps(error_body(503, f"the server has {max_connections} connections open, its limit "
                                      "(--max-connections); try again shortly", None, "server_busy")).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    return head + body
