"""`prefixlab replay TRACE`: what would this workload hit at other page sizes, budgets, policies?"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

from engine.eviction import POLICIES

from ..common_args import add_model_arg, bounded_int
from ..settings_table import SETTINGS
from .results import DEFAULT_POLICY, ReplayResult, parse_budget
from .trace import FORMATS, TraceError, open_trace, skipped_summary

MAX_WORKERS = 4 * (os.cpu_count() or 1)  # local processes; a Dask cluster (--dask-scheduler) for more


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="replay a trace through the prefix cache at other settings",
                       description=__doc__)
    p.add_argument("trace", help="a trace: prefixlab JSONL, Mooncake hash-id JSONL, or OpenAI chat bodies")
    p.add_argument("--format", choices=FORMATS, help="the trace's format (default: from its first line)")
    p.add_argument("--block-size", type=int, metavar="N",
                   help="tokens per hash id of a hash-id trace (Mooncake: 512)")
    p.add_argument("--page-rows", type=_int_list, default=[None], metavar="P,...",
                   help="page sizes to try (token traces; default: the trace's own)")
    p.add_argument("--budget", type=_budget_list, default=[None], metavar="B,...",
                   help="cache capacities in pages: integers or 'inf' (default: inf)")
    p.add_argument("--policy", type=_policy_list, default=[DEFAULT_POLICY], metavar="NAME,...",
                   help=f"eviction policies: {', '.join(POLICIES)} (default: {DEFAULT_POLICY})")
    p.add_argument("--disk-budget", type=_disk_budget_list, default=[None], metavar="D,...",
                   help="a disk tier of D pages under the budget: evicted pages move there and hit "
                        "again (two-tier curves; default: none)")
    p.add_argument("--json", metavar="OUT.json", help="write one row per configuration here")
    p.add_argument("--plot", metavar="OUT.png",
                   help="write hit ratio vs capacity per policy as a PNG here (with --replicas: hit "
                        "ratio and p99 TTFT vs replicas per router)")
    p.add_argument("--workers", type=bounded_int(1, MAX_WORKERS, " processes"), metavar="N",
                   help="parallel processes (default: one per core)")
    p.add_argument("--dask-scheduler", metavar="ADDRESS",
                   help="run the configurations on this Dask cluster (pip install 'prefixlab[dask]')")
    p.add_argument("--redact", metavar="OUT",
                   help="write the trace's Mooncake form (block hashes, no tokens) to OUT and stop")
    add_model_arg(p)  # an OpenAI log is tokenized with this model's chat template
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--strict", action="store_true",
                   help="refuse the trace at its first bad line (default: skip bad lines, count and "
                        "report them)")
    from .cluster_cli import add_cluster_args
    add_cluster_args(p)
    p.set_defaults(func=run)


def _int_list(text: str) -> list[int]:
    one = bounded_int(1, int(SETTINGS["page_rows"].high), " rows per page")
    return [one(v) for v in text.split(",")]


def _budget_list(text: str) -> list[int | None]:
    try:
        return [parse_budget(v) for v in text.split(",")]
    except ValueError as e:
        raise _bad(str(e)) from None


def _disk_budget_list(text: str) -> list[int | None]:
    """Disk tiers keep a slot list as long as their budget: bounded as --disk-tier-pages is."""
    high = int(SETTINGS["disk_tier_pages"].high)
    one = bounded_int(1, high, " pages")
    return [None if v.strip().lower() == "inf" else one(v) for v in text.split(",")]


def _policy_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",")]
    bad = [n for n in names if n not in POLICIES]
    if bad:
        raise _bad(f"unknown policy {bad[0]!r}; one of {', '.join(POLICIES)}")
    return names


def _bad(msg: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(msg)


def run(args) -> int:
    from .cluster_cli import cluster_mode, run_cluster, synthesize_command
    from .record import convert_to_prefixlab, redact_trace
    from .sweep import configurations, run_sweep
    if args.synthesize is not None:
        return synthesize_command(args)
    try:
        source = open_trace(args.trace, args.format, args.block_size, _tokenizer(args), strict=args.strict)
        with tempfile.TemporaryDirectory(prefix="prefixlab-replay-") as tmp:
            if source.tokenize is not None:  # tokenize once here; the workers read the result
                log = source
                source = convert_to_prefixlab(source, os.path.join(tmp, "trace.jsonl"))
                _say_skipped(args.trace, log.skipped.count, log.skipped.examples)
            if args.redact:
                n = redact_trace(source, args.redact, args.block_size)
                _say_skipped(args.trace, source.skipped.count, source.skipped.examples)
                print(f"wrote {args.redact}: {n} requests, block hashes of "
                      f"{args.block_size or source.header.page_rows} tokens, no token ids")
                return 0
            if source.hashed and args.page_rows != [None]:
                raise TraceError("--page-rows applies to token traces; a hash-id trace replays at "
                                 "its --block-size")
            if cluster_mode(args):
                return run_cluster(args, source)
            configs = configurations(args.page_rows, args.budget, args.policy, args.disk_budget)
            results = run_sweep(source, configs, workers=args.workers, dask_scheduler=args.dask_scheduler,
                                progress=not args.quiet and len(configs) > 1)
    except (TraceError, ValueError, RuntimeError) as e:
        raise SystemExit(f"prefixlab replay: {e}") from None
    _say_skipped(args.trace, results[0].skipped_lines, results[0].skipped)
    print(table(results))
    print(parts_table([config_label(r) for r in results], [r.parts for r in results]))
    rows = [r.to_json() for r in results]
    try:
        if args.json:
            _write_json(args.json, {"trace": os.path.abspath(args.trace), "format": source.format,
                                    "rows": rows})
            print(f"wrote {args.json}")
        if args.plot:
            from .plot import write_plot
            write_plot(args.plot, rows)
            print(f"wrote {args.plot}")
    except TraceError as e:
        raise SystemExit(f"prefixlab replay: {e}") from None
    return 0


def _say_skipped(path: str, count: int, examples: list[dict]) -> None:
    """One line on stderr for the bad lines a lenient read left out."""
    if count:
        print(f"prefixlab replay: {skipped_summary(path, count, examples)}", file=sys.stderr)


def _tokenizer(args):
    """For OpenAI logs only: the model's chat template and tokenizer, prompt = template + encode."""
    fmt = args.format
    if fmt is None:
        from .trace import detect_format
        try:
            fmt = detect_format(args.trace, args.strict)[0]
        except TraceError as e:
            raise SystemExit(f"prefixlab replay: {e}") from None
    if fmt != "openai":
        return None
    from ..common_args import load_model_or_exit
    tok = load_model_or_exit(getattr(args, "model", None)).tokenizer
    return lambda messages: tok.encode(tok.render_chat(messages, add_generation_prompt=True))


def _write_json(path: str, obj: dict) -> None:
    from ..report.files import ReportWriteError, write_bytes
    try:
        # strict JSON: a figure that is not finite (no requests, no time) is null, never Infinity
        write_bytes(path, json.dumps(finite_or_null(obj), indent=1, allow_nan=False).encode())
    except ReportWriteError as e:
        raise TraceError(f"cannot write {path}: {e.reason}") from None


def finite_or_null(value):
    """`value` with every NaN or infinite float replaced by None, for strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def config_label(r) -> str:
    """A configuration in a few words: "page 512, budget 3,000, leaf-lru" (clusters: replicas, router)."""
    words = [f"{r.replicas} x {r.router}"] if hasattr(r, "router") else [f"page {r.page_rows}"]
    words += [f"budget {'inf' if r.budget is None else f'{r.budget:,}'}", r.policy]
    if getattr(r, "disk_budget", None):
        words.append(f"disk {r.disk_budget:,}")
    return ", ".join(words)


def parts_table(labels: list[str], parts: list[dict[str, int]]) -> str:
    """Where the prompt tokens went, one line per configuration (docs/design.md §15): tokens by
    part, then the prompt tokens they add up to (`disk` is a share of `cached`)."""
    keys = list(parts[0]) if parts else []
    head = ("where the prompt tokens went", *keys, "prompt tokens")
    body = [(label, *(f"{p[k]:,}" for k in keys), f"{sum(v for k, v in p.items() if k != 'disk'):,}")
            for label, p in zip(labels, parts, strict=True)]
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
                     for cells in [head, *body])


def table(results: list[ReplayResult]) -> str:
    """The per-configuration table the CLI prints."""
    head = ("page size", "budget", "policy", "disk", "token hit ratio", "tokens saved", "blocks hit", "hits",
            "requests", "evicted", "s")
    body = [(str(r.page_rows), "inf" if r.budget is None else f"{r.budget:,}", r.policy,
             "-" if not r.disk_budget else f"{r.disk_budget:,}", f"{r.token_hit_ratio:.4f}",
             f"{r.tokens_saved:,}", f"{r.blocks_hit:,}", f"{r.hits:,}",
             f"{r.requests:,}", f"{r.evicted:,}", f"{r.seconds:.2f}") for r in results]
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]
    def line(cells) -> str:  # names left, numbers right
        return "  ".join(c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join(line(cells) for cells in [head, *body])
