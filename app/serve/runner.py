"""A running server: uvicorn on its own thread over a socket bound up front (clear port errors)."""

from __future__ import annotations

import errno
import json
import socket
import threading
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .budget import budget_info
from .guard import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, ConnectionLimit, limited
from .loop_thread import LoopThread
from .protocol import DEFAULT_MAX_TOKENS, error_body
from .server import Backend, create_app

START_TIMEOUT_S = 30.0


class ServeError(RuntimeError):
    """The server cannot start; the message says why and what to change."""


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or a ServeError naming the address (port 0: any free port)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ServeError(f"cannot listen on {host}:{port}: unknown host ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        why = "the port is in use (pick another with --port)" if e.errno == errno.EADDRINUSE else e.strerror
        raise ServeError(f"cannot listen on {host}:{port}: {why}") from None
    sock.set_inheritable(True)
    return sock


class JsonErrorsH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, its own 400 for a malformed request an OpenAI error object
    rather than plain text (what clients' error handling parses)."""

    def send_400_response(self, msg: str) -> None:
        error = error_body(400, f"malformed HTTP request: {msg}", None, "bad_http_request")
        body = json.dumps(error).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


class HttpThread:
    """uvicorn serving an ASGI app on a daemon thread; `stop()` closes connections and joins."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 8000, **config):
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2,
                                **{"http": JsonErrorsH11, **config})
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="prefixlab-http", daemon=True)

    @property
    def url(self) -> str:
        """The base address, e.g. http://127.0.0.1:8000."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> HttpThread:
        """Serve on the thread; return once uvicorn accepts connections."""
        self._thread.start()
        while not self.server.started and self._thread.is_alive():
            time.sleep(0.02)
        if not self.server.started:
            raise ServeError(f"the HTTP server on {self.url} did not start")
        return self

    def stop(self) -> None:
        """Close the connections (open ones get a grace period) and join the thread."""
        self.server.should_exit = True
        self._thread.join(10)
        self.sock.close()

    def is_alive(self) -> bool:
        """True while uvicorn serves."""
        return self._thread.is_alive()

    def serve_until(self, stop: threading.Event) -> bool:
        """Block while uvicorn serves; True when `stop` was set (a signal), False when it ended."""
        while self.is_alive() and not stop.wait(0.5):
            pass
        return stop.is_set()


def latest_row(scheduler) -> dict:
    """The scheduler's last timeline row as a dict (a list's last item: safe from another thread)."""
    rows = scheduler.timeline.rows if scheduler is not None else []
    return rows[-1].to_dict() if rows else {}


class Server:
    """`prefixlab serve` as an object: the engine loop on its thread over the model `load()` gives
    (with its SchedulerSettings; `prepare(scheduler)` before the first request), behind the HTTP app."""

    def __init__(self, load, host: str = "127.0.0.1", port: int = 8000, api_keys: list[str] | None = None,
                 cors: bool = False, default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
                 allowed_hosts: list[str] | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 prepare=None, max_connections: int | None = None,
                 idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S, metrics_key: str | None = None,
                 loop=None):
        self.engine = LoopThread(load, prepare, loop)
        self.backend = Backend(self.engine.loop, model=self._model, stats=self._stats,
                               load_error=lambda: self.engine.load_error, state=self.engine.state,
                               default_max_tokens=default_max_tokens, info=self._info)
        app = create_app(self.backend, api_keys, cors, host=host, allowed_hosts=allowed_hosts,
                         max_body_bytes=max_body_bytes, metrics_key=metrics_key)
        self.connections = ConnectionLimit(max_connections, idle_timeout_s)
        self.http = HttpThread(app, host, port, http=limited(JsonErrorsH11, self.connections))

    def _model(self):
        s = self.engine.scheduler
        return s.model if s is not None else None

    def _info(self) -> dict:
        return budget_info(self.engine.scheduler)

    def _stats(self) -> dict:
        return latest_row(self.engine.scheduler)

    @property
    def url(self) -> str:
        """The base address, e.g. http://127.0.0.1:8000."""
        return self.http.url

    def start(self) -> Server:
        """Serve at once (/health answers 503 while the engine thread loads the model)."""
        self.http.start()
        self.engine.start()
        return self

    def stop(self) -> None:
        """Cancel what runs (streams end with their finish chunk), then close the connections."""
        self.engine.stop()
        self.http.stop()
        self.backend.close()
