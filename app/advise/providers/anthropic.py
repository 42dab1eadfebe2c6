"""Anthropic's breakpoints, as its prompt-caching page documents them (sources in
resources/providers/anthropic.toml): a request's cache_control marks (at most 4; a top-level
cache_control is a mark on the last cacheable block) WRITE the prefix up to each mark; the
request READS the longest prefix ending at a block boundary, at most `lookback_blocks` boundaries
before one of its marks, that an EARLIER request wrote and that is still alive and readable (its
writer's answer had begun: the proxy's recorded first byte, else any strictly later arrival).
A read refreshes the entry's lifetime; tokens between the read and the last mark are written,
priced by the mark's lifetime (5 minutes, or 1 hour for "ttl": "1h"); tokens after the last mark
are plain input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..trie import PromptTrie
from .core import Step, prefix_digests, split

_PRUNE_EVERY = 1024  # requests between sweeps of expired entries (memory stays bounded by what lives)


@dataclass
class _Entry:
    tokens: int
    expires: float
    ready: float       # readable by requests arriving after this (when the writer's answer began)
    ttl: float


class Breakpoints:
    """Written prefixes per organization (the API key's tenant), by the digest of their tokens."""

    def __init__(self, rules):
        self.rules = rules
        self.entries: dict[str, dict[bytes, _Entry]] = {}
        self.tries: dict[str, PromptTrie] = {}   # L and the expired share, for the parts
        self.seen = 0

    def _lifetime(self, long: bool) -> float:
        r = self.rules
        return r.long_ttl_seconds if long and r.long_ttl_seconds else r.ttl_seconds

    def step(self, i: int, req, prompt) -> Step:
        r, tokens, now = self.rules, prompt.tokens, req.arrival_s
        n, minimum = len(tokens), r.min_for(req.model)
        marks = [m for m in prompt.marks[:r.max_marks] if m > 0]
        long = [k < len(prompt.long) and prompt.long[k] for k in range(len(marks))]
        bounds = sorted({b for b in prompt.blocks if 0 < b <= n} | set(marks))
        digests = prefix_digests(tokens, bounds)
        store = self.entries.setdefault(req.key, {})
        self._prune(now)

        read, hit, why = 0, None, ""
        for m in marks:
            at = bounds.index(m)
            for b in bounds[max(0, at - r.lookback_blocks):at + 1]:
                e = store.get(digests[b])
                if e is None or b <= read or b < minimum or now > e.expires:
                    continue
                if e.ready >= now:
                    why = "the prefix was still being written: its writer's answer had not begun"
                    continue
                read, hit = b, e
        if hit is not None:
            hit.expires = now + hit.ttl
            why = ""

        written = {False: 0, True: 0}
        last = read
        for m, lg in zip(marks, long):
            if m < minimum:
                continue
            if m > last:
                written[lg] += m - last
                last = m
            ttl, e = self._lifetime(lg), store.get(digests[m])
            began = now if req.answer_s is None else req.answer_s  # readable from then (else later arrivals)
            if e is not None and now <= e.expires:  # alive: refreshed, readable from the first start
                e.expires, e.ttl, e.ready = max(e.expires, now + ttl), max(e.ttl, ttl), min(e.ready, began)
            elif m > read:
                store[digests[m]] = _Entry(m, now + ttl, began, ttl)

        trie = self.tries.setdefault(req.key, PromptTrie())
        trie.ready(now)
        longest = trie.match(tokens, now, self._lifetime(any(long)))[0]
        ever = trie.match(tokens, now, math.inf)[0]
        trie.add_when_ready(i, tokens, now, now if req.answer_s is None else req.answer_s)
        if not marks:
            why = why or "no cache_control mark: nothing is read or written"
        parts = split(n, read, longest, ever, minimum, lost="no_breakpoint")
        return Step(longest, read, written[False], written[True], parts, why)

    def _prune(self, now: float) -> None:
        self.seen += 1
        if self.seen % _PRUNE_EVERY:
            return
        for store in self.entries.values():
            for d in [d for d, e in store.items() if now > e.expires]:
                del store[d]
