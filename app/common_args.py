"""Options shared by the headless commands: the model, sampling and scheduler settings."""

from __future__ import annotations

import argparse
import math

from engine import ModelLoadError, ModelNotInstalled, SamplingParams, load_model
from engine.scheduler import SchedulerSettings
from engine.stream import MAX_NEW_TOKENS

from .settings_table import SETTINGS, cli_help


def parse_count(text: str) -> int | None:
    """A whole number as a person types it (1000000, 1_000_000, 1,000,000 or 1e6); None if not one."""
    word = text.strip().replace("_", "").replace(",", "")
    try:
        return int(word)
    except ValueError:
        pass
    try:
        value = float(word)
    except ValueError:
        return None
    return int(value) if math.isfinite(value) and value.is_integer() else None


def bounded_int(low: int, high: int, what: str = ""):
    """An argparse type: an integer from `low` to `high` (`what` says what it counts); argparse's
    error names the flag, this one the bound."""
    def parse(text: str) -> int:
        value = parse_count(text)
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low:,} and at most {high:,}{what}, "
                                             f"got {text!r}")
        return value
    return parse


def table_int(name: str, low: int | None = None):
    """`bounded_int` with a setting's own limits from the settings table."""
    s = SETTINGS[name]
    return bounded_int(int(s.low) if low is None else low, int(s.high))


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Sampling options: the engine's SamplingParams defaults, help and limits from the settings table."""
    g = p.add_argument_group("sampling")
    d = SamplingParams()
    g.add_argument("--max-new", type=int, default=MAX_NEW_TOKENS,
                   help=cli_help("max_new_tokens") + f" (default {MAX_NEW_TOKENS}, or a scenario's own)")
    for flag, name, kind in (("--temp", "temperature", float), ("--top-k", "top_k", int),
                             ("--top-p", "top_p", float), ("--min-p", "min_p", float),
                             ("--repeat-penalty", "repeat_penalty", float)):
        g.add_argument(flag, type=kind, default=getattr(d, name),
                       help=cli_help(name) + " (default %(default)s)")
    g.add_argument("--repeat-last-n", type=int, default=d.repeat_last_n,
                   help="recent tokens the repetition penalty looks at (default %(default)s)")
    g.add_argument("--seed", type=int, default=None, help="a fixed seed makes sampling repeatable")


def sampling_from_args(args) -> SamplingParams:
    params = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                            seed=args.seed)
    params.validate()
    return params


def add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=argparse.SUPPRESS,
                   help="GGUF model file or built-in name (smollm2-135m, gemma3-270m; "
                        "default: the bundled SmolLM2-135M-Instruct)")


def load_model_or_exit(path: str | None):
    """Load the model (a file or a built-in name, installed on demand), or say why and exit (status 2)."""
    try:
        return load_model(path)
    except ModelNotInstalled as e:
        from .builtin_models import offer_install
        try:
            if offer_install(e.model):
                return load_model_or_exit(path)
        except RuntimeError as failed:
            raise SystemExit(f"prefixlab: {failed}") from None
        raise SystemExit(f"prefixlab: cannot load model: {e}") from None
    except ModelLoadError as e:
        raise SystemExit(f"prefixlab: cannot load model: {e}") from None


def add_scheduler_args(p: argparse.ArgumentParser):
    """The scheduler's settings as options, with SchedulerSettings' defaults."""
    g = p.add_argument_group("scheduler")
    d = SchedulerSettings()
    for flag, name in (("--max-streams", "max_streams"), ("--chunk-tokens", "chunk_tokens"),
                       ("--page-rows", "page_rows")):
        g.add_argument(flag, type=int, default=getattr(d, name),
                       help=cli_help(name) + " (default %(default)s)")
    g.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="requests that may wait (default %(default)s)")
    g.add_argument("--pool-pages", type=table_int("pool_pages", low=1), default=None,
                   help="bound the KV pool (default: grows)")
    g.add_argument("--cache-pages", type=int, default=d.cache_pages, help=cli_help("cache_pages"))
    g.add_argument("--no-cache", action="store_true", help="turn the prefix cache off")
    g.add_argument("--spec", action=argparse.BooleanOptionalAction, default=d.spec_enabled,
                   help="speculative decoding: " + cli_help("spec_enabled"))
    g.add_argument("--spec-k", type=int, default=d.spec_k,
                   help="speculative decoding: " + cli_help("spec_k") + " (default %(default)s)")
    add_cache_tier_args(g)
    return g


def add_cache_tier_args(g) -> None:
    """The cache's storage options (docs/design.md §12): page dtype, disk tier, persistence."""
    g.add_argument("--kv-dtype", choices=["f32", "f16"], default="f32",
                   help="how KV pages store K and V: f16 halves the bytes per page (attention still "
                        "computes in float32; default %(default)s)")
    g.add_argument("--disk-tier-pages", type=table_int("disk_tier_pages"), default=0, metavar="N",
                   help="a disk tier of N pages under the pool: a cached page about to be evicted moves "
                        "to a memory-mapped file and comes back on a hit (default 0: none)")
    g.add_argument("--persist-cache", metavar="DIR", default=None,
                   help="keep the prefix cache across restarts: load DIR's cache file at start (when it "
                        "matches the model), write it on exit")


def scheduler_settings_from_args(args) -> SchedulerSettings:
    """Checked SchedulerSettings from `add_scheduler_args` options (ValueError names the bad one)."""
    settings = SchedulerSettings(
        max_streams=args.max_streams, max_queue=args.max_queue, chunk_tokens=args.chunk_tokens,
        page_rows=args.page_rows, pool_pages=args.pool_pages, cache_pages=args.cache_pages,
        cache_enabled=not args.no_cache, spec_enabled=args.spec, spec_k=args.spec_k,
        kv_dtype=args.kv_dtype, disk_tier_pages=args.disk_tier_pages)
    settings.validate()
    return settings
