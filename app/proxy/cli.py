"""`prefixlab proxy --upstream URL`: forward OpenAI-compatible requests unchanged and record them."""

from __future__ import annotations

import sys
from dataclasses import fields
from urllib.parse import urlparse

from ..stop_signals import StopOnSignals
from .limits import DEFAULT_RECORD_MAX_BYTES, Limits

LIMIT_HELP = {
    "connect_timeout": "seconds to open a connection to the upstream (default %(default)s)",
    "read_timeout": "seconds the upstream may send nothing, before or within an answer (default %(default)s)",
    "total_timeout": "seconds one request may take, a stream included (default %(default)s)",
    "upstream_connections": "connections to the upstream, all requests together (default %(default)s)",
    "max_body_bytes": "largest request body; a larger one gets 413 (default %(default)s, 64 MiB)",
    "max_answer_bytes": "largest answer held whole (streams pass as they come); a larger one gets 502 "
                        "(default %(default)s, 64 MiB)",
    "max_decoded_bytes": "most of an answer decoded to read its usage; past it the answer passes "
                         "unread (default %(default)s, 16 MiB)",
    "max_line_bytes": "longest event-stream line read for usage; a longer one passes unread "
                      "(default %(default)s, 1 MiB)",
}


def add_parser(sub) -> None:
    p = sub.add_parser("proxy", help="a recording proxy in front of any OpenAI-compatible server",
                       description=__doc__)
    p.add_argument("--upstream", required=True, metavar="URL",
                   help="where requests go, e.g. https://api.openai.com/v1 or http://127.0.0.1:8080")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    p.add_argument("--port", type=int, default=8001, help="TCP port (default 8001; 0: any free port)")
    p.add_argument("--record", metavar="TRACE.jsonl",
                   help="append one line per request here (for `prefixlab advise`); API keys are "
                        "never written, the file is private (0600)")
    p.add_argument("--record-max-bytes", type=int, default=DEFAULT_RECORD_MAX_BYTES, metavar="N",
                   help="past this size the recording moves to TRACE.jsonl.1 and starts afresh "
                        "(default %(default)s, 256 MiB)")
    p.add_argument("--allowed-hosts", action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host header names NAME (repeat; '*': any). Default: "
                        "this machine's names and the --host address (keeps DNS rebinding out)")
    for f in fields(Limits):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default, metavar="N",
                       help=LIMIT_HELP[f.name])
    from ..serve.guard import add_connection_args  # the clients' connections, bounded as serve's are
    add_connection_args(p)
    p.set_defaults(func=run)


def check_upstream(url: str) -> str:
    """The upstream URL, or a ValueError saying what a usable one looks like."""
    parts = urlparse(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--upstream must be an http:// or https:// URL, got {url!r}")
    return url.rstrip("/")


class Proxy:
    """The proxy as an object: its app on an HTTP thread (tests and the desktop app start it)."""

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 8001, record: str | None = None,
                 limits: Limits | None = None, record_max_bytes: int = DEFAULT_RECORD_MAX_BYTES,
                 allowed_hosts: list[str] | None = None, max_connections: int | None = None,
                 idle_timeout_s: float | None = None):
        from ..serve.guard import DEFAULT_IDLE_TIMEOUT_S, ConnectionLimit, limited
        from ..serve.runner import HttpThread, JsonErrorsH11
        from .record import Recorder
        from .server import create_proxy_app
        self.upstream = check_upstream(upstream)
        # the clients' connections, as serve bounds its own (idle ones cannot exhaust the descriptors)
        self.connections = ConnectionLimit(
            max_connections, DEFAULT_IDLE_TIMEOUT_S if idle_timeout_s is None else idle_timeout_s, "proxy")
        self.recorder = Recorder(record, record_max_bytes)
        app = create_proxy_app(self.upstream, self.recorder, limits, host, allowed_hosts)
        # no Server or Date header of our own: the upstream's pass through as they are
        self.http = HttpThread(app, host, port, http=limited(JsonErrorsH11, self.connections),
                               server_header=False, date_header=False)

    @property
    def url(self) -> str:
        """The proxy's base address, e.g. http://127.0.0.1:8001."""
        return self.http.url

    def start(self) -> Proxy:
        self.http.start()
        return self

    def stop(self) -> None:
        self.http.stop()


def run(args) -> int:
    """Proxy until Ctrl-C or SIGTERM; a bad option or a port in use exits with a message."""
    from ..serve.runner import ServeError
    try:
        limits = Limits(**{f.name: getattr(args, f.name) for f in fields(Limits)})
        proxy = Proxy(args.upstream, args.host, args.port, args.record, limits, args.record_max_bytes,
                      args.allowed_hosts, args.max_connections, args.idle_timeout).start()
    except (ValueError, ServeError) as e:
        raise SystemExit(f"prefixlab proxy: {e}") from None
    where = f"; recording to {args.record}" if args.record else ""
    print(f"prefixlab proxy: {proxy.url}/v1 -> {proxy.upstream}{where}", flush=True)
    print(f"prefixlab proxy: point clients at OPENAI_BASE_URL={proxy.url}/v1", flush=True)
    with StopOnSignals() as stop:  # Ctrl+C or SIGTERM: a clean stop
        try:
            if proxy.http.serve_until(stop):
                print("prefixlab proxy: stopping", file=sys.stderr)
        finally:
            proxy.stop()
    return 0
