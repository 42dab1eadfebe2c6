"""Hosted APIs' prompt-cache rules as data: one TOML file per provider (docs/design.md §14).

Every file says when it was true (`as_of`) and where it comes from (`source`), so a
person can check each number; `--rules FILE` adds their own. A bad file is refused
with an error naming the file and the field.
"""

from __future__ import annotations

import datetime
import math
import os
import tomllib
from dataclasses import dataclass, field

from ..scenario import REPO_ROOT

PROVIDER_DIR = os.path.join(REPO_ROOT, "resources", "providers")
DEFAULT_RULES = ("openai", "anthropic", "gemini", "deepseek", "mistral", "prefixlab")
PRICE_FIELDS = ("input", "cached_input", "cache_write", "output")
# a write with the long lifetime (Anthropic's "ttl": "1h": 2x input); an explicit cache's storage per hour
OPTIONAL_PRICES = ("cache_write_long", "storage_per_million_hour")
# How the cache behaves beyond the common prefix core (app/advise/providers/): a named model each.
BEHAVIOURS = ("prefix", "anthropic-breakpoints", "openai-routing", "deepseek-units")
# USD: 10 cents a token, far past any model's. A guard against typos: 1e308 times a trace's
# tokens is Infinity, which no JSON reader takes
MAX_PRICE_PER_MILLION = 100_000.0
_FIELDS = {"name", "as_of", "source", "model", "note", "min_prefix_tokens", "granularity_tokens",
           "ttl_seconds", "breakpoints", "tokenizer", "price_per_million", "behaviour", "sources",
           "unmodelled", "min_prefix_by_model", "long_ttl_seconds", "lookback_blocks", "max_marks",
           "overflow_per_minute", "overflow_machines", "routing_prefix_tokens", "unit_interval_tokens",
           "scale_to_usage"}


class RulesError(ValueError):
    """A rule set that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class Prices:
    """USD per million tokens."""

    input: float
    cached_input: float
    cache_write: float
    output: float
    cache_write_long: float | None = None  # None: the long lifetime costs what the default one does
    storage_per_million_hour: float | None = None  # an explicit cache's storage (Gemini); None: none

    def write(self, long: bool) -> float:
        """The price of a token written with the long (else the default) lifetime."""
        return self.cache_write_long if long and self.cache_write_long is not None else self.cache_write


@dataclass(frozen=True)
class RuleSet:
    """One provider's cache rules and prices."""

    name: str
    as_of: str
    source: str
    min_prefix_tokens: int
    granularity_tokens: int
    ttl_seconds: float       # math.inf: nothing expires by time
    breakpoints: bool
    tokenizer: str           # "model": the loaded model's; else a built-in model name or a GGUF path
    prices: Prices
    model: str = ""
    note: str = ""
    path: str = ""
    behaviour: str = "prefix"
    sources: dict = field(default_factory=dict)        # rule -> "URL (date)"
    unmodelled: tuple = ()                             # documented rules this file cannot express
    min_prefix_by_model: dict = field(default_factory=dict)  # model name prefix -> its own minimum
    long_ttl_seconds: float = 0.0    # the longer lifetime a request may ask for (1 h, 24 h); 0: none
    lookback_blocks: int = 20        # anthropic-breakpoints: block boundaries checked before a mark
    max_marks: int = 4               # anthropic-breakpoints: marks a request may carry
    overflow_per_minute: int = 0     # openai-routing: requests a minute one machine takes per prefix+key
    overflow_machines: int = 0       # openai-routing: the other machines the overflow is spread over
    routing_prefix_tokens: int = 256  # openai-routing: the tokens hashed to pick the machine
    unit_interval_tokens: int = 0    # deepseek-units: a stored unit every this many tokens (0: none)
    scale_to_usage: bool = False     # no public tokenizer: local counts scaled to a recording's usage

    def __post_init__(self):
        if self.breakpoints and self.behaviour == "prefix":  # an older file's `breakpoints = true`
            object.__setattr__(self, "behaviour", "anthropic-breakpoints")

    def min_for(self, model: str) -> int:
        """The minimum for requests to `model`: the longest matching `min_prefix_by_model` prefix."""
        hits = [k for k in self.min_prefix_by_model if model.startswith(k)]
        return self.min_prefix_by_model[max(hits, key=len)] if hits else self.min_prefix_tokens

    def cached(self, common_prefix: int, minimum: int | None = None) -> int:
        """Cached tokens for a longest common prefix of `common_prefix` tokens (the §14 formula)."""
        if common_prefix < (self.min_prefix_tokens if minimum is None else minimum):
            return 0
        return common_prefix // self.granularity_tokens * self.granularity_tokens

    def to_json(self) -> dict:
        """The rule set as JSON-ready data (infinity as null)."""
        return {"name": self.name, "as_of": self.as_of, "source": self.source, "model": self.model,
                "note": self.note, "min_prefix_tokens": self.min_prefix_tokens,
                "granularity_tokens": self.granularity_tokens,
                "ttl_seconds": None if math.isinf(self.ttl_seconds) else self.ttl_seconds,
                "breakpoints": self.breakpoints, "tokenizer": self.tokenizer,
                "price_per_million": {k: v for k, v in vars(self.prices).items() if v is not None},
                "behaviour": self.behaviour, "sources": dict(self.sources),
                "unmodelled": list(self.unmodelled), "min_prefix_by_model": dict(self.min_prefix_by_model),
                "long_ttl_seconds": self.long_ttl_seconds, "lookback_blocks": self.lookback_blocks,
                "max_marks": self.max_marks, "overflow_per_minute": self.overflow_per_minute,
                "overflow_machines": self.overflow_machines,
                "routing_prefix_tokens": self.routing_prefix_tokens,
                "unit_interval_tokens": self.unit_interval_tokens, "scale_to_usage": self.scale_to_usage}


class _Checker:
    """Field readers for one file that fail with an error naming the file and the field."""

    def __init__(self, path: str, data: dict):
        self.path, self.data = path, data

    def error(self, name: str, what: str) -> RulesError:
        return RulesError(f"{self.path}: field '{name}' {what}")

    def get(self, name: str, table: dict | None = None, prefix: str = ""):
        table = self.data if table is None else table
        if name not in table:
            raise self.error(prefix + name, "is missing")
        return table[name]

    def text(self, name: str, required: bool = True) -> str:
        v = self.get(name) if required else self.data.get(name, "")
        if not isinstance(v, str) or (required and not v.strip()):
            raise self.error(name, f"must be a non-empty string, got {v!r}")
        return v

    def integer(self, name: str, low: int, table: dict | None = None, prefix: str = "") -> int:
        v = self.get(name, table, prefix)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.error(prefix + name, f"must be an integer, got {v!r}")
        if v < low:
            what = "is negative" if v < 0 else "is too small"
            raise self.error(prefix + name, f"{what}: {v} (it must be >= {low})")
        return v

    def number(self, name: str, table: dict | None = None, prefix: str = "", positive: bool = False,
               allow_inf: bool = False, high: float = math.inf, unit: str = "") -> float:
        v = self.get(name, table, prefix)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
        if not ok or (math.isinf(v) and not allow_inf):
            raise self.error(prefix + name, f"must be a number, got {v!r}")
        if v < 0 or (positive and v == 0):
            raise self.error(prefix + name, f"must be {'> 0' if positive else '>= 0'}, got {v!r}")
        if v > high:
            raise self.error(prefix + name, f"is {v:g}, over the limit of {high:,g}{unit}")
        return float(v)

    def date(self, name: str) -> str:
        v = self.get(name)
        if isinstance(v, datetime.date):
            return v.isoformat()[:10]
        try:
            return datetime.date.fromisoformat(v).isoformat()
        except (TypeError, ValueError):
            raise self.error(name, f"must be a date (YYYY-MM-DD), got {v!r}") from None


def parse_rules(path: str, data: dict) -> RuleSet:
    """A RuleSet from a TOML document's data, checked field by field."""
    c = _Checker(path, data)
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise c.error(unknown[0], f"is unknown (known fields: {', '.join(sorted(_FIELDS))})")
    if not isinstance(data.get("breakpoints", False), bool):
        raise c.error("breakpoints", f"must be true or false, got {data['breakpoints']!r}")
    table = c.get("price_per_million")
    if not isinstance(table, dict):
        raise c.error("price_per_million", "must be a table ([price_per_million])")
    extra = sorted(set(table) - set(PRICE_FIELDS) - set(OPTIONAL_PRICES))
    if extra:
        raise c.error(f"price_per_million.{extra[0]}",
                      f"is unknown (known: {', '.join(PRICE_FIELDS + OPTIONAL_PRICES)})")
    prices = Prices(**{k: c.number(k, table, "price_per_million.", high=MAX_PRICE_PER_MILLION,
                                   unit=" USD per million tokens")
                       for k in (*PRICE_FIELDS, *(f for f in OPTIONAL_PRICES if f in table))})
    behaviour = data.get("behaviour", "anthropic-breakpoints" if data.get("breakpoints") else "prefix")
    if behaviour not in BEHAVIOURS:
        raise c.error("behaviour", f"must be one of {', '.join(BEHAVIOURS)}, got {behaviour!r}")
    sources = data.get("sources", {})
    if not isinstance(sources, dict) or not all(isinstance(v, str) and v.strip() for v in sources.values()):
        raise c.error("sources", "must be a table of rule = \"URL (date)\" strings ([sources])")
    unmodelled = data.get("unmodelled", [])
    if not isinstance(unmodelled, list) or not all(isinstance(v, str) for v in unmodelled):
        raise c.error("unmodelled", "must be a list of strings")
    by_model = data.get("min_prefix_by_model", {})
    if not isinstance(by_model, dict):
        raise c.error("min_prefix_by_model", "must be a table of model = tokens")
    by_model = {k: c.integer(k, 0, by_model, "min_prefix_by_model.") for k in by_model}
    ints = {k: c.integer(k, 0) for k in ("lookback_blocks", "max_marks", "overflow_per_minute",
                                         "overflow_machines", "routing_prefix_tokens",
                                         "unit_interval_tokens") if k in data}
    long_ttl = c.number("long_ttl_seconds") if "long_ttl_seconds" in data else 0.0
    if not isinstance(data.get("scale_to_usage", False), bool):
        raise c.error("scale_to_usage", f"must be true or false, got {data['scale_to_usage']!r}")
    return RuleSet(behaviour=behaviour, sources=dict(sources), unmodelled=tuple(unmodelled),
                   min_prefix_by_model=by_model, long_ttl_seconds=long_ttl, **ints,
                   scale_to_usage=data.get("scale_to_usage", False),
                   name=c.text("name"), as_of=c.date("as_of"), source=c.text("source"),
                   min_prefix_tokens=c.integer("min_prefix_tokens", 0),
                   granularity_tokens=c.integer("granularity_tokens", 1),
                   ttl_seconds=c.number("ttl_seconds", positive=True, allow_inf=True),
                   breakpoints=behaviour == "anthropic-breakpoints",
                   tokenizer=c.text("tokenizer", required=False) or "model", prices=prices,
                   model=c.text("model", required=False), note=c.text("note", required=False), path=path)


def load_rules(path: str) -> RuleSet:
    """A rule set from a TOML file; RulesError names the file and what is wrong."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as e:
        raise RulesError(f"cannot read rules file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise RulesError(f"{path}: not valid TOML ({e})") from None
    except UnicodeDecodeError:
        raise RulesError(f"{path}: not UTF-8 text") from None
    return parse_rules(path, data)


def shipped() -> list[str]:
    """The names of the rule sets in resources/providers."""
    return sorted(f[:-5] for f in os.listdir(PROVIDER_DIR) if f.endswith(".toml"))


def resolve_rules(spec: str | None) -> list[RuleSet]:
    """`--rules`: comma-separated shipped names and/or TOML files (None: every shipped set)."""
    names = [s.strip() for s in (spec or ",".join(DEFAULT_RULES)).split(",") if s.strip()]
    if not names:
        raise RulesError("--rules names no rule set")
    out = []
    for name in names:
        if name.endswith(".toml") or os.sep in name:
            out.append(load_rules(name))
        elif name in shipped():
            out.append(load_rules(os.path.join(PROVIDER_DIR, name + ".toml")))
        else:
            raise RulesError(f"unknown rule set {name!r}: one of {', '.join(shipped())}, or a .toml file")
    seen = set()
    for r in out:
        if r.name in seen:
            raise RulesError(f"two rule sets are named {r.name!r} ({r.path}); names must differ")
        seen.add(r.name)
    return out
