"""A copy of the scheduler's state for another thread: the UI reads this, never the engine."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from .attention import window_first_page
from .metrics import RequestRecord, TimelineRow
from .prefix_cache import ChainRecord, prefix_chain_list


@dataclass
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

    def take(self, scheduler, since_row: int = 0) -> Snapshot:
        cache, pool, tok = scheduler.cache, scheduler.pool, scheduler.model.tokenizer
        rows = pool.page_rows
        states = scheduler.page_states()
        pages: dict[int, PageInfo] = {}
        live_keys = set()
        for page, key in cache.by_page.items():
            entry = cache.pages[key]
            live_keys.add(key)
            text = self._text_by_key.get(key)
            if text is None:
                text = self._text_by_key[key] = tok.decode(entry.tokens)
            pages[page] = PageInfo(page, int(pool.refcount[page]), int(states[page]), entry.chain_id,
                                   first_position=entry.depth * rows, text=text)
        cfg = scheduler.model.config
        private_texts: dict[tuple[int, ...], str] = {}
        for stream in scheduler.streams():
            s = stream.session
            if s is None:
                continue
            first = window_first_page(s.n_past, cfg.sliding_window, rows)
            for i, page in enumerate(s.page_table):
                info = pages.get(page)
                if info is None:
                    toks = tuple(s.tokens[i * rows:(i + 1) * rows])
                    text = private_texts[toks] = self._text_by_tokens.get(toks) or tok.decode(list(toks))
                    info = pages[page] = PageInfo(page, int(pool.refcount[page]), int(states[page]),
                                                  first_position=i * rows, text=text)
                info.owners.append(stream.id)
                if cfg.sliding_window and not info.read_by:
                    info.read_by = _read_by(cfg, i >= first)
        for key in [k for k in self._text_by_key if k not in live_keys]:
            del self._text_by_key[key]
        self._text_by_tokens = private_texts
        return Snapshot(
            timeline=list(scheduler.timeline.rows[since_row:]),
            page_states=states.copy(),
            refcounts=pool.refcount.copy(),
            pages=pages,
            chains=[copy.copy(c) for c in prefix_chain_list(cache)],
            records=[copy.copy(r) for r in scheduler.records()],
            page_rows=rows,
            prefill_tok_s=scheduler.prefill_rate(),
            seconds_saved=scheduler.seconds_saved(),
        )
