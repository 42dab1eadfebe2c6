"""`prefixlab watch`: follow serving engines' prefix caches headless, then write them as JSON."""

from __future__ import annotations

import argparse
import json
import time

from engine.atomic import atomic_write

from ..stop_signals import StopOnSignals
from .state import DEFAULT_MAX_BLOCKS


def add_parser(sub) -> None:
    """Register `prefixlab watch`."""
    p = sub.add_parser(
        "watch", help="watch engines' KV-event feeds (vLLM's format) or a llama.cpp server",
        description="Subscribe to KV-event feeds in vLLM's wire format (vLLM, SGLang, TensorRT-LLM, "
                    "`prefixlab serve --kv-events`) and rebuild each engine's prefix cache; or poll a "
                    "llama.cpp server's /slots and /metrics. Prints a line per batch (per poll) and "
                    "writes the final state as JSON at the end of --duration and on Ctrl+C / SIGTERM.")
    p.add_argument("--kv-events", nargs="+", metavar="ENDPOINT", default=[],
                   help="engine event endpoints to connect to, one per instance or data-parallel rank "
                        "(e.g. tcp://127.0.0.1:5557)")
    p.add_argument("--kv-events-replay", nargs="+", metavar="ENDPOINT", default=[],
                   help="replay endpoints, in the same order as --kv-events (repairs sequence gaps)")
    p.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="each endpoint is a vLLM started with this many data-parallel ranks: watch ports "
                        "PORT..PORT+N-1 (vLLM adds the rank to the port), replay ports likewise")
    p.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per block, for feeds whose events do not say")
    p.add_argument("--max-blocks", type=int, default=DEFAULT_MAX_BLOCKS,
                   help="most blocks kept per engine; stores past it are counted, not kept")
    p.add_argument("--max-frame-mb", type=float, default=16.0,
                   help="largest message accepted; a bigger one is refused by ZeroMQ (default 16)")
    p.add_argument("--llama-server", metavar="URL", help="poll this llama.cpp server instead")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between llama.cpp polls")
    p.add_argument("--model", default=argparse.SUPPRESS,
                   help="GGUF model whose tokenizer shows the chains' first tokens as text")
    p.add_argument("--json", metavar="OUT", help="write the final state here")
    p.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--quiet", action="store_true", help="no line per batch")
    p.set_defaults(func=run)


def rank_endpoints(endpoints: list[str], ranks: int) -> list[str]:
    """Each tcp endpoint once per data-parallel rank, its port offset by the rank (as vLLM binds them)."""
    if ranks < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {ranks}")
    if ranks == 1:
        return endpoints
    out = []
    for ep in endpoints:
        base, _, port = ep.rpartition(":")
        if not ep.startswith("tcp://") or not port.isdigit():
            raise ValueError(f"--data-parallel-size needs tcp://HOST:PORT endpoints, got {ep}")
        out.extend(f"{base}:{int(port) + r}" for r in range(ranks))
    return out


def _write_json(path: str | None, data: dict) -> None:
    if not path:
        return
    text = json.dumps(data, indent=1).encode("utf-8")
    atomic_write(path, lambda fh: fh.write(text))  # a reader never sees half a file
    print(f"wrote {path}", flush=True)


def _previews(model_path, snapshot: dict) -> None:
    from app.common_args import load_model_or_exit
    from engine import decode
    model = load_model_or_exit(model_path)
    for eng in snapshot["engines"]:
        for chain in eng["chains"]:
            chain["preview"] = decode(model, chain["first_tokens"])


def run(args) -> int:
    """Watch until --duration ends or a signal comes; print the summary; write the JSON."""
    if bool(args.kv_events) == bool(args.llama_server):
        raise SystemExit("prefixlab watch: give one of --kv-events ENDPOINT [...] or --llama-server URL")
    if args.llama_server:
        return _run_llama(args)
    from app.kv_wire import normalize_endpoint

    from .subscriber import Watcher
    try:
        endpoints = rank_endpoints([normalize_endpoint(e) for e in args.kv_events], args.data_parallel_size)
        replays = rank_endpoints([normalize_endpoint(e) for e in args.kv_events_replay],
                                 args.data_parallel_size)
        watcher = Watcher(endpoints, replays, topic=args.topic, block_size=args.block_size,
                          max_blocks=args.max_blocks, max_frame=int(args.max_frame_mb * 1024 * 1024))
    except ValueError as e:
        raise SystemExit(f"prefixlab watch: {e}") from None
    for feed in watcher.feeds:
        replay = f", replay {feed.replay_endpoint}" if feed.replay_endpoint else ", no replay"
        print(f"engine {feed.state.index} = {feed.state.endpoint}{replay}, topic {args.topic!r}", flush=True)
    started = time.time()

    def line(r) -> None:  # one printed line per batch
        if args.quiet:
            return
        what = [f"+{r.stored} stored", f"-{r.removed} removed"]
        if r.cleared:
            what.append("cleared")
        if r.bad_events:
            what.append(f"{r.bad_events} bad events")
        tag = " (replayed)" if r.replayed else ""
        print(f"engine {r.engine} seq {r.seq}: {', '.join(what)}; live {r.live}{tag}", flush=True)

    try:
        with StopOnSignals() as stop:
            watcher.run(args.duration, line, stop)
    finally:
        snap = watcher.snapshot(with_blocks=True)
        watcher.close()
    snap["watched_seconds"] = round(time.time() - started, 3)
    if getattr(args, "model", None):
        _previews(args.model, snap)
    for eng in snap["engines"]:
        print(f"engine {eng['engine']}: {eng['live_blocks']} live blocks, {eng['stored_blocks']} stored, "
              f"{eng['removed_blocks']} removed, {eng['cleared']} cleared, {eng['seq_gaps']} gaps, "
              f"{eng['bad_frames']} bad frames", flush=True)
    _write_json(args.json, snap)
    return 0


def _run_llama(args) -> int:
    from .llama_server import LlamaServerPoller
    try:
        poller = LlamaServerPoller(args.llama_server)
    except ValueError as e:
        raise SystemExit(f"prefixlab watch: {e}") from None
    end = None if args.duration is None else time.monotonic() + args.duration
    with StopOnSignals() as stop:
        while True:  # at least one poll, even with --duration 0
            sample = poller.poll()
            if not args.quiet:
                print(sample.line(), flush=True)
            wait = args.interval if end is None else min(args.interval, max(0.0, end - time.monotonic()))
            if stop.wait(wait) or (end is not None and time.monotonic() >= end):
                break
    _write_json(args.json, poller.to_json())
    return 0

