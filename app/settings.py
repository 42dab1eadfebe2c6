"""The app's preferences: validated, remembered with QSettings, turned into engine arguments."""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, fields

from PySide6.QtCore import QSettings

from engine.block_manager import pages_for
from engine.sampler import SamplingParams
from engine.scheduler import SchedulerSettings
from engine.stream import reserved_positions

from .secrets import load_api_key, save_api_key
from .serve.kv_events import normalize_endpoint

ORGANIZATION = "PrefixLab"
APPLICATION = "PrefixLab"
MAX_RECENT_MODELS = 8
MAX_SPEC_K = 16      # the Settings dialog's bound on drafted tokens per stream and step



def qsettings() -> QSettings:
    """The app's settings store: an INI file in the user scope (tests redirect it with setPath)."""
    return QSettings(QSettings.Format.IniFormat, QSettings.Scope.UserScope, ORGANIZATION, APPLICATION)


@dataclass
class AppSettings:
    """Every preference the Settings dialog edits."""

    page_rows: int = 16
    pool_pages: int = 0          # 0: the pool grows
    cache_pages: int = 0         # cache budget in pages; 0: unbounded
    max_streams: int = SchedulerSettings.max_streams
    chunk_tokens: int = SchedulerSettings.chunk_tokens   # engine/stream.py says why
    cache_enabled: bool = True
    spec_enabled: bool = SchedulerSettings.spec_enabled  # speculative decoding (the scheduler's default)
    spec_k: int = SchedulerSettings.spec_k               # tokens drafted per stream and step
    namespace: str = ""
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.1
    seed: int = -1               # -1: a fresh seed per request
    max_new_tokens: int = 64
    server_host: str = "127.0.0.1"   # the Server toggle's address (this machine only by default)
    server_port: int = 8000
    server_api_key: str = ""         # empty: no key asked; kept by app/secrets.py, never in QSettings
    server_api_key_remember: bool = False  # without a keyring: keep the key in a 0600 file
    server_kv_events: str = ""       # empty: off; else where the Server publishes the cache (vLLM's events)

    # validation -----------------------------------------------------------
    def errors(self) -> list[str]:
        """Every problem with these values, one readable sentence each (empty when valid)."""
        errs, bad = [], set()

        def need_int(name: str, low: int, high: int) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                bad.add(name)
                errs.append(f"{label(name)} must be a whole number from {low} to {high}, got {value!r}")

        need_int("page_rows", 1, 4096)
        need_int("pool_pages", 0, 1_000_000)
        need_int("cache_pages", 0, 1_000_000)
        need_int("max_streams", 1, 64)
        need_int("chunk_tokens", 1, 65_536)
        need_int("spec_k", 1, MAX_SPEC_K)
        need_int("top_k", 0, 1_000_000)
        need_int("seed", -1, 2**31 - 1)
        need_int("max_new_tokens", 1, 65_536)
        need_int("server_port", 1, 65_535)
        if not self.server_host or len(self.server_host) > 253 or any(c.isspace() for c in self.server_host):
            errs.append(f"Server host must be a host name or address, got {self.server_host!r}")
        if any(ord(c) < 33 for c in self.server_api_key) or len(self.server_api_key) > 200:
            errs.append("Server API key must be at most 200 characters, without spaces")
        if self.server_kv_events:
            try:
                normalize_endpoint(self.server_kv_events)
            except ValueError as e:
                errs.append(f"Server KV events: {e}")
        if not 0.0 <= self.temperature <= 10.0:
            errs.append(f"Temperature must be from 0 (greedy) to 10, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            errs.append(f"Top-p must be above 0 and at most 1, got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            errs.append(f"Min-p must be at least 0 and below 1, got {self.min_p}")
        if not 0.0 < self.repeat_penalty <= 10.0:
            errs.append(f"Repetition penalty must be above 0 and at most 10, got {self.repeat_penalty}")
        if len(self.namespace) > 200 or any(ord(c) < 32 for c in self.namespace):
            errs.append("Namespace must be at most 200 printable characters")
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
    def scheduler_settings(self) -> SchedulerSettings:
        """The engine scheduler's settings these preferences choose (0 pool pages: a growing pool)."""
        return SchedulerSettings(max_streams=self.max_streams, chunk_tokens=self.chunk_tokens,
                                 page_rows=self.page_rows, pool_pages=self.pool_pages or None,
                                 cache_pages=self.cache_pages, cache_enabled=self.cache_enabled,
                                 spec_enabled=self.spec_enabled, spec_k=self.spec_k)

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
        default = cls()
        values = {}
        store.beginGroup("settings")
        for f in fields(cls):
            raw = store.value(f.name, None)
            values[f.name] = _coerce(raw, getattr(default, f.name))
        store.endGroup()
        values["server_api_key"] = load_api_key(store)
        loaded = cls(**values)
        return loaded if not loaded.errors() else default


LABELS = {
    "page_rows": "Page rows", "pool_pages": "Pool pages", "cache_pages": "Cache budget",
    "max_streams": "Max streams", "chunk_tokens": "Chunk tokens", "cache_enabled": "Prefix cache",
    "spec_enabled": "Speculative decoding", "spec_k": "Draft tokens (k)",
    "namespace": "Namespace", "temperature": "Temperature", "top_k": "Top-k", "top_p": "Top-p",
    "min_p": "Min-p", "repeat_penalty": "Repetition penalty", "seed": "Seed",
    "max_new_tokens": "Max new tokens", "server_host": "Server host", "server_port": "Server port",
    "server_api_key": "Server API key", "server_kv_events": "Server KV events",
    "server_api_key_remember": "Remember the API key",
}


def label(name: str) -> str:
    return LABELS.get(name, name)


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
