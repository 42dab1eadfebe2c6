"""`prefixlab replay TRACE --twin`: the options, the cost file's lookup, the run and its output
(docs/design.md §16)."""

from __future__ import annotations

import argparse
import os

from .trace import TraceError


def add_twin_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the twin: predicted latency (docs/design.md §16)")
    g.add_argument("--twin", action="store_true",
                   help="predict each request's queueing, TTFT, time per output token and end with the "
                        "engine's own scheduler over a fitted step cost (with --replicas/--router: N twins)")
    g.add_argument("--cost", metavar="FILE.json",
                   help="the step cost (default: the one `prefixlab calibrate` kept for --model)")
    g.add_argument("--slo-ttft", type=_seconds, metavar="S", help="goodput: TTFT at most S seconds")
    g.add_argument("--slo-tpot", type=_seconds, metavar="S",
                   help="goodput: time per output token at most S seconds")
    g.add_argument("--max-streams", type=int, default=8, metavar="N", help="the twin's streams per replica")
    g.add_argument("--chunk-tokens", type=int, default=512, metavar="N", help="the twin's prefill chunk")
    g.add_argument("--pool-pages", type=int, metavar="N",
                   help="the twin's KV pool per replica in pages (default: grows, as serve's)")
    g.add_argument("--draws", type=_draws, default=1, metavar="N",
                   help="run the trace N times, each pass's time drawn from the cost's measured spread "
                        "(seeds --seed, +1, ...), and report each figure's mean (default 1; a short trace's "
                        "percentiles move from draw to draw)")
    g.add_argument("--per-request", metavar="OUT.jsonl", help="write each request's predicted figures here "
                                                              "(the first draw's)")
    g.add_argument("--against", metavar="URL",
                   help="send the trace to this OpenAI-compatible server at its arrival times and report "
                        "measured beside the twin's prediction (e.g. http://127.0.0.1:8000)")
    g.add_argument("--speed", type=_speed, default=1.0, metavar="X",
                   help="--against and --twin: arrivals X times as fast as the trace's (default 1)")
    g.add_argument("--served-model", metavar="NAME", help="--against: the model name to send "
                                                          "(default: the server's first)")


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"an SLO is a number of seconds > 0, got {text!r}")
    return v


def _draws(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--draws is a whole number >= 1, got {text!r}")
    return int(text)


def _speed(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"--speed is a number > 0, got {text!r}")
    return v


def load_cost(path: str | None, model: str | None):
    """The cost file given, else the model's calibrated one; ValueError says how to get one."""
    from .stepcost import StepCost
    if path:
        return StepCost.load(path), path
    import engine as dl

    from .calibrate import cost_path
    try:
        found = cost_path(dl.resolve_model(model))
    except Exception as e:  # noqa: BLE001 - no model to look one up for
        raise ValueError(f"no step cost: give --cost FILE ({e})") from None
    if not os.path.exists(found):
        raise ValueError(f"no step cost for this model on this machine yet: run `prefixlab calibrate` "
                         f"(or give --cost FILE); looked for {found}")
    return StepCost.load(found), found


def twin_config(args, cost):
    from engine.stream import SchedulerSettings

    from .routers import RouterKnobs
    from .twin_replay import TwinConfig
    if len(args.page_rows) > 1:
        raise ValueError("--twin runs one configuration: give one --page-rows")
    settings = SchedulerSettings(max_streams=args.max_streams, chunk_tokens=args.chunk_tokens,
                                 pool_pages=args.pool_pages,
                                 page_rows=args.page_rows[0] or SchedulerSettings.page_rows)
    settings.validate()
    routers = args.router or ["round-robin"]
    replicas = args.replicas or [1]
    if len(routers) > 1 or len(replicas) > 1:
        raise ValueError("--twin runs one configuration: give one --replicas N and one --router")
    knobs = RouterKnobs(args.seed, args.balance_abs, args.balance_rel, args.overlap_weight, args.hash_balance)
    return TwinConfig(cost, settings, replicas[0], routers[0], knobs, args.slo_ttft, args.slo_tpot,
                      speed=args.speed, seed=args.seed)


def run_twin(args, source) -> int:
    """Predict the trace; print the summary; --json and --per-request write the figures."""
    from .cli import _write_json
    from .twin_replay import predict_draws, summary, write_per_request
    try:
        cost, where = load_cost(args.cost, getattr(args, "model", None))
        config = twin_config(args, cost)
    except ValueError as e:
        raise TraceError(str(e)) from None
    print(f"step cost: {where} (measured on {cost.machine or 'an unnamed machine'})", flush=True)
    per, close = write_per_request(args.per_request) if args.per_request else (None, lambda: None)
    try:
        if args.quiet:
            res, _ = predict_draws(source, config, args.draws, per_request=per)
        else:
            from tqdm import tqdm
            with tqdm(unit="req", desc="twin", leave=False) as bar:
                res, _ = predict_draws(source, config, args.draws, progress=lambda n: bar.update(n - bar.n),
                                       per_request=per)
    finally:
        close()
    print(summary(res))
    if args.per_request:
        print(f"wrote {args.per_request}")
    if args.json:
        _write_json(args.json, {"trace": os.path.abspath(args.trace), "cost": cost.to_json(),
                                "twin": res.to_json()})
        print(f"wrote {args.json}")
    return 0


def run_against(args, source) -> int:
    """Send the trace to --against, then predict it with the twin; print both and the errors."""
    from . import against
    from .cli import _write_json
    from .twin_replay import predict_draws, summary
    try:
        cost, where = load_cost(args.cost, getattr(args, "model", None))
        config = twin_config(args, cost)
    except ValueError as e:
        raise TraceError(str(e)) from None
    print(f"sending the trace to {args.against} at {args.speed:g}x its arrival times ...", flush=True)
    measured = against.send(args.against, source, args.speed, args.served_model)
    res, runs = predict_draws(source, config, args.draws, keep=True)
    cmp = against.compare(measured, runs)
    print(against.table(measured, runs[0]))
    print(f"step cost: {where}")
    print(summary(res))
    print(against.summary(cmp))
    if args.json:
        _write_json(args.json, {"trace": os.path.abspath(args.trace), "against": args.against,
                                "speed": args.speed, "cost": cost.to_json(), "twin": res.to_json(),
                                "compare": cmp, "measured": [m.__dict__ for m in measured]})
        print(f"wrote {args.json}")
    return 0 if cmp["measured_ok"] == cmp["requests"] else 1
