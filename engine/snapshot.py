"""A copy of the scheduler's state for another thread: the UI reads this, never the engine."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from .api import prefix_chain_list
from .attention import window_first_page
from .metrics import RequestRecord, TimelineRow
from .prefix_records import ChainRecord

NO_OWNERS: list[int] = []  # shared by cached pages no session holds (never appended to)


@dataclass(slots=True)
class PageInfo:
    """What a page-map tooltip shows about one pool page."""

    page: int
    refcount: int
    state: int
    chain_id: int | None = None
    owners: list[int] = field(default_factory=list)  # request ids whose session holds the page
    first_position: int | None = None
    text: str = ""
    read_by: str = ""  # sliding-window models: which layers the owner's next step still reads it with


@dataclass(slots=True)
class TierPageInfo:
    """What the page map shows of one page in the disk tier (oldest stored first)."""

    slot: int
    chain_id: int
    first_position: int
    text: str = ""


@dataclass
class Snapshot:
    """Everything the charts, page map and tables draw, copied out of the engine."""

    timeline: list[TimelineRow]
    page_states: np.ndarray
    refcounts: np.ndarray
    pages: dict[int, PageInfo]
    chains: list[ChainRecord]
    records: list[RequestRecord]
    page_rows: int
    prefill_tok_s: float
    seconds_saved: float
    kv_dtype: str = "float32"
    bytes_per_page: int = 0
    disk_pages: int = 0          # cached pages in the disk tier (none in the pool's page map)
    disk_capacity: int = 0       # 0: no disk tier
    disk_hit_pages: int = 0      # pages attached from the disk tier so far
    disk_load_s: float = 0.0     # the time loading them back took
    disk_tier: list[TierPageInfo] = field(default_factory=list)  # the disk tier's pages


def _read_by(cfg, in_window: bool) -> str:
    if in_window:
        return "all layers"
    n_global = sum(not cfg.is_sliding(i) for i in range(cfg.n_layers))
    return (f"{n_global} full-attention layer{'s' * (n_global != 1)} only (it lies before the "
            f"{cfg.sliding_window}-position window of the other {cfg.n_layers - n_global})")


class SnapshotMaker:
    """Builds snapshots; remembers page texts so each page's tokens are decoded once."""

    def __init__(self):
        self._text_by_key: dict[int, str] = {}
        self._text_by_tokens: dict[tuple[int, ...], str] = {}  # private pages, while they live
        self._tier_text: dict[int, str] = {}  # disk-tier pages' texts, by key, while they stay

    def take(self, scheduler, since_row: int = 0) -> Snapshot:
        cache, pool, tok = scheduler.cache, scheduler.pool, scheduler.model.tokenizer
        rows = pool.page_rows
        states = scheduler.page_states()
        refs = pool.refcount  # one array for the whole snapshot: O(pages), not O(pages^2)
        ref_of, state_of = refs.tolist(), states.tolist()  # plain ints: indexing numpy costs 10x
        pages: dict[int, PageInfo] = {}
        texts = self._text_by_key
        for entry in cache.entries():  # each cached page names its chain (what chain_of(page) reads)
            page, key = entry.page, entry.key
            text = texts.get(key)
            if text is None:
                text = texts[key] = tok.decode(entry.tokens)
            pages[page] = PageInfo(page, ref_of[page], state_of[page], entry.chain_id, NO_OWNERS,
                                   entry.depth * rows, text)  # positional: 12k of these at 16k pages
        cfg = scheduler.model.config
        private_texts: dict[tuple[int, ...], str] = {}
        for stream in scheduler.streams():
            s = stream.session
            if s is None:
                continue
            first = window_first_page(s.n_past, cfg.sliding_window, rows)
            tokens = s.tokens  # one copy per session, not one per page
            for i, page in enumerate(s.page_table):
                info = pages.get(page)
                if info is None:
                    toks = tuple(tokens[i * rows:(i + 1) * rows])
                    text = private_texts[toks] = self._text_by_tokens.get(toks) or tok.decode(list(toks))
                    info = pages[page] = PageInfo(page, ref_of[page], state_of[page],
                                                  first_position=i * rows, text=text)
                if info.owners is NO_OWNERS:
                    info.owners = []
                info.owners.append(stream.id)
                if cfg.sliding_window and not info.read_by:
                    info.read_by = _read_by(cfg, i >= first)
        if len(texts) > len(cache.pages):  # forget the texts of pages no longer cached
            self._text_by_key = {k: t for k, t in texts.items() if k in cache.pages}
        self._text_by_tokens = private_texts
        return Snapshot(
            timeline=list(scheduler.timeline.rows[since_row:]),
            page_states=states.copy(),
            refcounts=refs.copy(),
            pages=pages,
            chains=prefix_chain_list(cache),  # copies already
            records=[copy.copy(r) for r in scheduler.records()],
            page_rows=rows,
            prefill_tok_s=scheduler.prefill_rate(),
            seconds_saved=scheduler.seconds_saved(),
            kv_dtype=getattr(pool, "kv_dtype", "float32"),
            bytes_per_page=getattr(pool, "bytes_per_page", 0),
            **self._tier_fields(cache, tok, rows),
        )

    def _tier_fields(self, cache, tok, rows: int) -> dict:
        """The disk tier's counts and pages (each page's text decoded once while it stays)."""
        tier = cache.tier
        if tier is None:
            return {}
        old, texts = self._tier_text, {}
        pages = []
        for tp in tier.pages.values():
            text = texts[tp.key] = old.get(tp.key) or tok.decode(list(tp.tokens))
            pages.append(TierPageInfo(tp.slot, tp.chain_id, tp.depth * rows, text))
        self._tier_text = texts
        return {"disk_pages": len(tier), "disk_capacity": tier.capacity, "disk_tier": pages,
                "disk_hit_pages": cache.counters.disk_hit_pages, "disk_load_s": tier.load_seconds}
