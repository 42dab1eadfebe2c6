"""`prefixlab proxy --upstream URL`: forward OpenAI-compatible requests unchanged and record them."""

from __future__ import annotations

import sys
from urllib.parse import urlparse

from ..stop_signals import StopOnSignals


def add_parser(sub) -> None:
    p = sub.add_parser("proxy", help="a recording proxy in front of any OpenAI-compatible server",
                       description=__doc__)
    p.add_argument("--upstream", required=True, metavar="URL",
                   help="where requests go, e.g. https://api.openai.com/v1 or http://127.0.0.1:8080")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    p.add_argument("--port", type=int, default=8001, help="TCP port (default 8001; 0: any free port)")
    p.add_argument("--record", metavar="TRACE.jsonl",
                   help="append one line per request here (for `prefixlab advise`); API keys are "
                        "never written")
    p.set_defaults(func=run)


def check_upstream(url: str) -> str:
    """The upstream URL, or a ValueError saying what a usable one looks like."""
    parts = urlparse(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--upstream must be an http:// or https:// URL, got {url!r}")
    return url.rstrip("/")


class Proxy:
    """The proxy as an object: its app on an HTTP thread (tests and the desktop app start it)."""

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 8001, record: str | None = None):
        from ..serve.runner import HttpThread
        from .record import Recorder
        from .server import create_proxy_app
        self.upstream = check_upstream(upstream)
        self.recorder = Recorder(record)
        # no Server or Date header of our own: the upstream's pass through as they are
        self.http = HttpThread(create_proxy_app(self.upstream, self.recorder), host, port,
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
        proxy = Proxy(args.upstream, args.host, args.port, args.record).start()
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
