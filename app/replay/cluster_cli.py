"""`prefixlab replay TRACE --replicas 1,2,4 --router ...`: the cluster options, table, JSON and plot;
and `prefixlab replay --synthesize N OUT`."""

from __future__ import annotations

import argparse
import itertools
import os

from ..common_args import bounded_int
from .cluster import MAX_SLOTS, ClusterConfig, ClusterResult, ServiceModel, replay_cluster, replica_counts
from .routers import ROUTERS, RouterKnobs, check_routers
from .synth import MAX_SYNTHESIZE
from .trace import TraceError


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """The cluster and synthesis options of `prefixlab replay`."""
    g = p.add_argument_group("clusters (docs/design.md §13)")
    g.add_argument("--replicas", type=_replica_list, metavar="N,...",
                   help="replay over N replicas, each with its own cache of --budget pages (e.g. 1,2,4,8)")
    g.add_argument("--router", type=_router_list, metavar="NAME,...",
                   help=f"routers in front of the replicas: {', '.join(ROUTERS)} (default: all)")
    g.add_argument("--prefill-rate", type=_rate, metavar="TOK/S",
                   help="a replica's prefill tokens/s (default: this machine's engine, measured once)")
    g.add_argument("--decode-rate", type=_rate, metavar="TOK/S",
                   help="decode tokens/s of each running request (default: measured, at --slots streams)")
    g.add_argument("--slots", type=bounded_int(1, MAX_SLOTS, " slots"), metavar="N",
                   help="requests a replica runs at once (default: the scheduler's streams, 8)")
    g.add_argument("--seed", type=int, default=0,
                   help="the random router's seed (and --synthesize's, and the twin's draws')")
    g.add_argument("--balance-abs", type=int, default=RouterKnobs.balance_abs, metavar="TOKENS",
                   help="cache-aware: balance load when the gap exceeds this many tokens ...")
    g.add_argument("--balance-rel", type=float, default=RouterKnobs.balance_rel, metavar="X",
                   help="... and the busiest replica carries X times the idlest's load")
    g.add_argument("--overlap-weight", type=float, default=RouterKnobs.overlap_weight, metavar="W",
                   help="kv-cost: W x blocks to prefill + blocks being decoded")
    g.add_argument("--hash-balance", type=_balance, default=RouterKnobs.hash_balance, metavar="X",
                   help="prefix-hash: overflow past X times the mean load (consistent hashing with "
                        "bounded loads; 0: never overflow)")
    g.add_argument("--synthesize", type=bounded_int(1, MAX_SYNTHESIZE, " requests"), metavar="N",
                   help="write a seeded N-request Mooncake trace with Zipf-shared prefixes to TRACE and stop")


def _replica_list(text: str) -> list[int]:
    try:
        return replica_counts(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _router_list(text: str) -> list[str]:
    try:
        return check_routers(v.strip() for v in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _rate(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"a rate is a number of tokens/s > 0, got {text!r}")
    return v


def _balance(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (v == 0 or 1 <= v < float("inf")):
        raise argparse.ArgumentTypeError(
            f"--hash-balance is 0 (never overflow) or a factor >= 1, got {text!r}")
    return v


def cluster_mode(args) -> bool:
    return args.replicas is not None or args.router is not None


def synthesize_command(args) -> int:
    from .synth import synthesize
    try:
        n = synthesize(args.synthesize, args.trace, seed=args.seed)
    except (TraceError, ValueError) as e:
        raise SystemExit(f"prefixlab replay: {e}") from None
    print(f"wrote {args.trace}: {n:,} requests (Mooncake format, 512-token blocks, seed {args.seed})")
    return 0


def service_from_args(args) -> tuple[ServiceModel, str]:
    """The service model: the rates given, the rest this machine's measured defaults."""
    given = (args.prefill_rate, args.decode_rate, args.slots)
    if None not in given:
        return ServiceModel(*given), "given"
    from .rates import default_service
    measured, where = default_service(getattr(args, "model", None),
                                      log=None if args.quiet else lambda m: print(m, flush=True))
    return ServiceModel(args.prefill_rate or measured.prefill_rate, args.decode_rate or measured.decode_rate,
                        args.slots or measured.slots), where


def cluster_configs(replicas, routers, budgets, policies, page_rows, service: ServiceModel,
                    knobs: RouterKnobs) -> list[ClusterConfig]:
    """Every combination, in the order replicas, router, budget, policy, page size."""
    return [ClusterConfig(n, r, service, b, pol, p, knobs)
            for n, r, b, pol, p in itertools.product(replicas, routers, budgets, policies, page_rows)]


def run_cluster(args, source) -> int:
    """Sweep the cluster configurations of `args` over `source`; print, write JSON and PNG."""
    from .cli import _say_skipped, _write_json, config_label, parts_table
    from .sweep import run_sweep
    service, where = service_from_args(args)
    knobs = RouterKnobs(args.seed, args.balance_abs, args.balance_rel, args.overlap_weight, args.hash_balance)
    configs = cluster_configs(args.replicas or [1], args.router or list(ROUTERS), args.budget, args.policy,
                              args.page_rows, service, knobs)
    if len(configs) == 1 and not args.dask_scheduler:  # one long replay: count its requests instead
        results = [_one_with_progress(source, configs[0], quiet=args.quiet)]
    else:
        results = run_sweep(source, configs, workers=args.workers, dask_scheduler=args.dask_scheduler,
                            progress=not args.quiet and len(configs) > 1, fn=replay_cluster)
    print(f"service model per replica: prefill {service.prefill_rate:,.1f} tok/s, decode "
          f"{service.decode_rate:,.2f} tok/s per request, {service.slots} slots ({where})")
    _say_skipped(args.trace, results[0].skipped_lines, results[0].skipped)
    print(cluster_table(results))
    print(parts_table([config_label(r) for r in results], [r.parts for r in results]))
    rows = [r.to_json() for r in results]
    if args.json:
        _write_json(args.json, {"trace": os.path.abspath(args.trace), "format": source.format,
                                "service": service.__dict__, "service_source": where, "rows": rows})
        print(f"wrote {args.json}")
    if args.plot:
        from .plot import write_cluster_plot
        write_cluster_plot(args.plot, rows)
        print(f"wrote {args.plot}")
    return 0


def _one_with_progress(source, config: ClusterConfig, quiet: bool) -> ClusterResult:
    if quiet:
        return replay_cluster(source, config)
    from tqdm import tqdm
    with tqdm(unit="req", desc="replay", leave=False) as bar:
        return replay_cluster(source, config, progress=lambda done: bar.update(done - bar.n))


def cluster_table(results: list[ClusterResult]) -> str:
    """One line per (replicas, router, budget, policy)."""
    head = ("replicas", "router", "budget", "policy", "hit ratio", "per replica", "imbalance",
            "TTFT p50 s", "TTFT p99 s", "s")
    body = []
    for r in results:
        per = [p["token_hit_ratio"] for p in r.per_replica]
        body.append((str(r.replicas), r.router, "inf" if r.budget is None else f"{r.budget:,}", r.policy,
                     f"{r.token_hit_ratio:.4f}", f"{min(per):.3f}-{max(per):.3f}", f"{r.load_imbalance:.2f}",
                     f"{r.ttft_p50_s:,.2f}", f"{r.ttft_p99_s:,.2f}", f"{r.seconds:.1f}"))
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]

    def line(cells) -> str:
        return "  ".join(c.ljust(w) if i in (1, 3) else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join(line(cells) for cells in [head, *body])
