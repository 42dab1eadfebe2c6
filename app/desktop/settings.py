"""The app's preferences: validated, remembered with QSettings, turned into engine arguments."""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING

from engine.block_manager import pages_for
from engine.sampler import SamplingParams
from engine.scheduler import SchedulerSettings
from engine.stream import reserved_positions

from ..kv_wire import normalize_endpoint
from ..serve.budget import DEFAULT_KV_BUDGET, budget_info, headline, parse_budget, share_words, with_budget
from ..settings_table import SETTINGS, TABLE, default
from .secrets import load_api_key, save_api_key

if TYPE_CHECKING:  # the engine side (desktop_engine.py) uses AppSettings without Qt
    from PySide6.QtCore import QSettings

ORGANIZATION = "PrefixLab"
APPLICATION = "PrefixLab"
MAX_RECENT_MODELS = 8


def qsettings() -> QSettings:
    """The app's settings store: an INI file in the user scope (tests redirect it with setPath)."""
    from PySide6.QtCore import QSettings

    return QSettings(QSettings.Format.IniFormat, QSettings.Scope.UserScope, ORGANIZATION, APPLICATION)


def kept_cache_root(store: QSettings) -> str:
    """Where "Keep the cache across restarts" writes: kv-cache/ beside the settings file."""
    return os.path.join(os.path.dirname(os.path.abspath(store.fileName())), "kv-cache")


@dataclass
class AppSettings:
    """Every preference the Settings dialog edits (defaults and limits: app/settings_table.py)."""

    page_rows: int = default("page_rows")
    pool_pages: int = default("pool_pages")        # 0: the default KV budget's pages
    cache_pages: int = default("cache_pages")      # cache budget in pages; 0: the whole pool
    max_streams: int = default("max_streams")
    chunk_tokens: int = default("chunk_tokens")    # engine/stream.py says why
    cache_enabled: bool = default("cache_enabled")
    spec_enabled: bool = default("spec_enabled")   # speculative decoding
    spec_k: int = default("spec_k")                # tokens drafted per stream and step
    namespace: str = default("namespace")
    kv_dtype: str = default("kv_dtype")            # how pages store K/V: float32 | float16
    disk_tier_pages: int = default("disk_tier_pages")  # 0: no disk tier
    keep_cache: bool = default("keep_cache")       # save at quit, load after a model loads
    temperature: float = default("temperature")
    top_k: int = default("top_k")
    top_p: float = default("top_p")
    min_p: float = default("min_p")
    repeat_penalty: float = default("repeat_penalty")  # the window's own default: the table says why
    seed: int = default("seed")                    # -1: a fresh seed per request
    max_new_tokens: int = default("max_new_tokens")
    server_host: str = default("server_host")      # the Server toggle's address (this machine only)
    server_port: int = default("server_port")
    server_api_key: str = default("server_api_key")  # empty: no key asked
    server_kv_events: str = default("server_kv_events")  # empty: off; else where the cache is published
    server_api_key_remember: bool = default("server_api_key_remember")  # no keyring: a 0600 file

    # validation -----------------------------------------------------------
    def errors(self) -> list[str]:
        """Every problem with these values, one readable sentence each (empty when valid)."""
        errs, bad = [], set()
        for s in TABLE:
            value = getattr(self, s.name)
            if s.low is not None and s.out_of_range(value):
                bad.add(s.name)
                kind = "a whole number" if s.kind == "int" else "a number"
                errs.append(f"{s.label} must be {kind} {s.range_words()}, got {value!r}")
        if not self.server_host or len(self.server_host) > 253 or any(c.isspace() for c in self.server_host):
            errs.append(f"{_label('server_host')} must be a host name or address, got {self.server_host!r}")
        if any(ord(c) < 33 for c in self.server_api_key) or len(self.server_api_key) > 200:
            errs.append(f"{_label('server_api_key')} must be at most 200 characters, without spaces")
        if self.server_kv_events:
            try:
                normalize_endpoint(self.server_kv_events)
            except ValueError as e:
                errs.append(f"{_label('server_kv_events')}: {e}")
        for s in TABLE:
            if s.choices and getattr(self, s.name) not in s.choices:
                errs.append(f"{s.label} must be one of {', '.join(s.choices)}, got {getattr(self, s.name)!r}")
        if len(self.namespace) > 200 or any(ord(c) < 32 for c in self.namespace):
            errs.append(f"{_label('namespace')} must be at most 200 printable characters")
        return errs + self._fit_errors(bad)

    def _fit_errors(self, bad: set[str]) -> list[str]:
        """Problems of values valid alone but not together (pool, request and cache sizes)."""
        errs = []
        if self.pool_pages and not bad & {"page_rows", "pool_pages", "max_new_tokens"}:
            # One request must fit: the pages the engine reserves for a one-token prompt, the
            # answer and the turn's closing tokens (no model here, so no context limit).
            need = pages_for(reserved_positions(1, self.max_new_tokens, sys.maxsize), self.page_rows)
            if self.pool_pages < need:
                errs.append(f"Pool pages ({self.pool_pages}) cannot hold even one request of "
                            f"{self.max_new_tokens} new tokens at {self.page_rows} positions per page: "
                            f"use at least {need} pages, or 0 to let the pool grow")
        if not bad & {"pool_pages", "cache_pages"} and self.cache_pages and self.pool_pages \
                and self.cache_pages > self.pool_pages:
            errs.append(f"Cache budget ({self.cache_pages} pages) is larger than the pool "
                        f"({self.pool_pages} pages)")
        return errs

    def validate(self) -> None:
        errs = self.errors()
        if errs:
            raise ValueError("; ".join(errs))

    # engine arguments -------------------------------------------------------
    def scheduler_settings(self, model=None) -> SchedulerSettings:
        """The engine scheduler's settings these preferences choose. For a `model`, a pool left at
        0 pages gets the default KV budget's (a share of RAM, as `prefixlab serve` starts with):
        the app's cache must not keep every prefix forever. A cache budget stays within it."""
        s = SchedulerSettings(max_streams=self.max_streams, chunk_tokens=self.chunk_tokens,
                              page_rows=self.page_rows, pool_pages=self.pool_pages or None,
                              cache_pages=self.cache_pages, cache_enabled=self.cache_enabled,
                              spec_enabled=self.spec_enabled, spec_k=self.spec_k,
                              kv_dtype=self.kv_dtype, disk_tier_pages=self.disk_tier_pages)
        if model is None or self.pool_pages:
            return s
        # the pool's bound alone comes from the budget, so a cache budget is a live change
        bounded = with_budget(replace(s, cache_pages=0), model, parse_budget(DEFAULT_KV_BUDGET))
        if bounded.pool_pages is None:  # this system does not say its RAM: no budget
            return s
        return replace(bounded, cache_pages=min(self.cache_pages, bounded.pool_pages) or bounded.pool_pages)

    def kv_budget(self, scheduler) -> dict:
        """The KV budget `scheduler` runs under, with its one line for the window and reports:
        "KV budget 2.35 GiB (10% of RAM): 3,190 pages"."""
        info = budget_info(scheduler)
        if scheduler.settings.pool_pages is None:
            return {**info, "kv_budget_bytes": 0,
                    "line": "KV budget: none, the pool grows (Settings → Pool pages bounds it)"}
        source = "Settings" if self.pool_pages else share_words(DEFAULT_KV_BUDGET)
        line = headline(info["kv_budget_bytes"], info["kv_budget_pages"], source)
        if scheduler.settings.cache_pages < info["kv_budget_pages"] and scheduler.settings.cache_enabled:
            line += f", the cache at most {scheduler.settings.cache_pages:,}"
        return {**info, "line": line}

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              min_p=self.min_p, repeat_penalty=self.repeat_penalty,
                              seed=None if self.seed < 0 else self.seed)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> AppSettings:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    # persistence ------------------------------------------------------------
    def save(self, store: QSettings | None = None) -> None:
        store = store or qsettings()
        store.beginGroup("settings")
        for f in fields(self):
            if f.name != "server_api_key":  # a secret: the keyring or a private file
                store.setValue(f.name, getattr(self, f.name))
        store.endGroup()
        save_api_key(store, self.server_api_key, self.server_api_key_remember)
        store.sync()

    @classmethod
    def load(cls, store: QSettings | None = None) -> AppSettings:
        """The remembered settings; a missing or unreadable value falls back to its default."""
        store = store or qsettings()
        defaults = cls()
        values = {}
        store.beginGroup("settings")
        for f in fields(cls):
            raw = store.value(f.name, None)
            values[f.name] = _coerce(raw, getattr(defaults, f.name))
        store.endGroup()
        values["server_api_key"] = load_api_key(store)
        loaded = cls(**values)
        return loaded if not loaded.errors() else defaults


def _label(name: str) -> str:
    return SETTINGS[name].label


def _coerce(raw, default):
    """QSettings' INI values come back as strings; turn one into the default's type."""
    if raw is None:
        return default
    try:
        if isinstance(default, bool):
            return raw if isinstance(raw, bool) else str(raw).lower() in ("true", "1", "yes")
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
        return str(raw)
    except (TypeError, ValueError):
        return default


# recent models ----------------------------------------------------------------
def recent_models(store: QSettings | None = None) -> list[str]:
    store = store or qsettings()
    value = store.value("recent_models", [])
    if isinstance(value, str):
        value = [value] if value else []
    return [str(v) for v in (value or [])][:MAX_RECENT_MODELS]


def add_recent_model(path: str, store: QSettings | None = None) -> list[str]:
    """Put `path` first in the recent models list; return the list."""
    store = store or qsettings()
    paths = [path] + [p for p in recent_models(store) if p != path]
    paths = paths[:MAX_RECENT_MODELS]
    store.setValue("recent_models", paths)
    store.sync()
    return paths
