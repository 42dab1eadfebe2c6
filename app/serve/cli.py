"""`prefixlab serve`: the scheduler behind an OpenAI-compatible HTTP server (docs/design.md §8)."""

from __future__ import annotations

import os
import sys

import engine  # noqa: F401 - first: it sets OpenBLAS's thread timeout before NumPy loads OpenBLAS

from ..cache_persist import persist_from_args
from ..common_args import add_model_arg, add_scheduler_args, bounded_int, scheduler_settings_from_args
from ..stop_signals import StopOnSignals
from .budget import DEFAULT_KV_BUDGET, describe, parse_budget, with_budget
from .guard import (
    DEFAULT_MAX_BODY_BYTES,
    DRAIN_LIMIT_BYTES,
    add_connection_args,
    check_connection_options,
    default_max_connections,
)
from .kv_events_publisher import add_kv_events_args, publisher_from_args
from .protocol import DEFAULT_MAX_TOKENS


def add_parser(sub) -> None:
    """The `serve` subcommand and its options."""
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    p.add_argument("--port", type=bounded_int(0, 65_535), default=8000, help="TCP port (0: any free port)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require this bearer key (repeat for several tenants; each key is its own "
                        "cache namespace); also read from PREFIXLAB_API_KEY")
    p.add_argument("--cors", action="store_true", help="allow cross-origin requests from any web page")
    p.add_argument("--allowed-hosts", action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host header names NAME (repeat; '*': any). Default: "
                        "this machine's names and the --host address (keeps DNS rebinding out)")
    p.add_argument("--max-body-bytes", type=bounded_int(1, DRAIN_LIMIT_BYTES, " bytes"),
                   default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help="largest request body; a larger one gets 413 (default %(default)s, 8 MiB)")
    add_connection_args(p)
    p.add_argument("--kv-budget", default=DEFAULT_KV_BUDGET, metavar="SIZE",
                   help="KV memory (the pool running requests and the prefix cache share): a share of "
                        "RAM (10%%) or a size (2GiB, 500MB); 0: none. --pool-pages or --cache-pages, "
                        "when given, win (default %(default)s of RAM)")
    p.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                   help="answer limit of a request that sets no max_tokens (default: the context, "
                        "as OpenAI's; a bounded --pool-pages reserves every page of it at admission)")
    p.add_argument("--metrics-key", metavar="KEY", default=None,
                   help="bearer key /metrics asks for (it counts every tenant's traffic, so with "
                        "--api-key it answers only this key); also read from PREFIXLAB_METRICS_KEY")
    p.add_argument("--metrics-isolated", action="store_true",
                   help="count prompt tokens another namespace had as 'isolated' in /metrics (default: "
                        "as 'new', so one tenant's scrape says nothing of another's traffic)")
    p.add_argument("--step-log", metavar="STEPS.jsonl", default=None,
                   help="append what each pass ran and its seconds to this file, for `prefixlab calibrate "
                        "--from-log` (the twin's cost of this server under its own traffic)")
    add_scheduler_args(p)
    add_kv_events_args(p)
    p.set_defaults(func=run)


def step_log_loop(path: str | None):
    """The engine loop that logs each pass (`--step-log`), or None for the plain one."""
    if not path:
        return None
    from engine.step_log import StepLogLoop
    try:
        return StepLogLoop(path)
    except OSError as e:
        raise SystemExit(f"prefixlab serve: --step-log {path}: cannot write it: {e.strerror or e}") from None


def model_loader(model_path: str | None, settings, kv_budget: int = 0):
    """What the engine thread calls to load the model: it returns (model, SchedulerSettings),
    from which the loop builds its scheduler. Without a cache budget in `settings`, `kv_budget`
    bytes become one (pages of this model)."""
    def load():
        from engine import load_model
        model = load_model(model_path)
        return model, with_budget(settings, model, kv_budget)
    return load


def run(args) -> int:
    """Serve until Ctrl-C; a bad option or a port in use exits with a message."""
    from .runner import ServeError, Server

    try:
        settings = scheduler_settings_from_args(args)
        if args.default_max_tokens is not None and args.default_max_tokens < 1:
            raise ValueError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
        check_connection_options(default_max_connections() if args.max_connections is None
                                 else args.max_connections, args.idle_timeout)
        kv_budget = 0 if settings.cache_pages or settings.pool_pages else parse_budget(args.kv_budget)
        loop = step_log_loop(args.step_log)  # an unwritable --step-log fails before anything binds
        publisher = publisher_from_args(args)  # binds now: a taken port fails before the model loads
    except ValueError as e:
        raise SystemExit(f"prefixlab serve: {e}") from None
    keys = list(args.api_key) + [k for k in [os.environ.get("PREFIXLAB_API_KEY")] if k]
    persisted: list = []  # --persist-cache: loaded on the engine thread before the first request

    def prepare(scheduler) -> None:
        if publisher:
            publisher.attach(scheduler.cache)
        persisted.extend(filter(None, [persist_from_args(args, scheduler)]))
    try:
        server = Server(model_loader(getattr(args, "model", None), settings, kv_budget),
                        args.host, args.port, api_keys=keys, cors=args.cors,
                        default_max_tokens=args.default_max_tokens, allowed_hosts=args.allowed_hosts,
                        max_body_bytes=args.max_body_bytes, prepare=prepare,
                        max_connections=args.max_connections, idle_timeout_s=args.idle_timeout,
                        metrics_key=args.metrics_key or os.environ.get("PREFIXLAB_METRICS_KEY") or None,
                        loop=loop)
        server.backend.ttft.show_isolated = args.metrics_isolated
        server.start()
    except ServeError as e:
        _close(publisher)
        raise SystemExit(f"prefixlab serve: {e}") from None
    print(f"prefixlab serve: listening on {server.url}/v1 (loading the model...)", flush=True)
    if publisher:
        replay = f", replay on {publisher.replay_endpoint}" if publisher.replay_endpoint else ""
        print(f"prefixlab serve: KV events on {publisher.endpoint}{replay} (vLLM's format; ZeroMQ has "
              "no authentication)", flush=True)
    with StopOnSignals() as stop:  # Ctrl+C or SIGTERM (docker stop, systemd): a clean stop
        try:
            while not server.engine.ready.wait(0.2):
                if stop.is_set():
                    return 0
            if server.engine.load_error:
                raise SystemExit(f"prefixlab serve: cannot load model: {server.engine.load_error}")
            info = server.backend.info()
            budget = describe(info["kv_budget_bytes"], info["kv_budget_pages"], args.kv_budget)
            print(f"prefixlab serve: {budget}", flush=True)
            print(f"prefixlab serve: ready; point clients at OPENAI_BASE_URL={server.url}/v1", flush=True)
            while server.http.is_alive() and not stop.wait(0.5):
                pass
            if stop.is_set():
                print("prefixlab serve: stopping", file=sys.stderr)
        finally:
            server.stop()
            for p in persisted:  # the engine thread has stopped: the cache is still
                p.save()
            _close(publisher)
    return 0


def _close(publisher) -> None:
    if publisher is not None:
        publisher.close()
