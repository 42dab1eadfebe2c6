"""The common core of §14 for prefix caches that match automatically (OpenAI, Gemini implicit,
Mistral, this engine): the longest common prefix with an earlier prompt still alive in the same
scope, floored to the granularity, nothing under the minimum; a hit refreshes what it matched."""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from hashlib import blake2b

from ..trie import PromptTrie


@dataclass
class Step:
    """One request under one provider: tokens read, written (default / long lifetime), and the
    prompt's tokens by cause (summing to the prompt)."""

    common_prefix: int            # L: the longest common prefix with a live earlier prompt in scope
    read: int
    written: int = 0
    written_long: int = 0
    parts: dict = field(default_factory=dict)
    why: str = ""                 # the model's own word on this request (overflow, ...), or ""


def prefix_digests(tokens: list[int], ends: list[int]) -> dict[int, bytes]:
    """A digest of tokens[:e] for each e of the sorted `ends` (one pass over the tokens)."""
    h, at, out = blake2b(digest_size=16), 0, {}
    for e in ends:
        h.update(array("q", tokens[at:e]).tobytes())
        at = e
        out[e] = h.copy().digest()
    return out


def split(n: int, read: int, shared: int, ever: int, minimum: int, lost: str = "rounding") -> dict:
    """The prompt's n tokens by cause: `read` cached; the rest of the `shared` live prefix lost to
    the minimum or to `lost` (rounding, a missing breakpoint, ...); what only an expired prompt
    shared; the rest new."""
    shared = max(shared, read)
    parts = {"cached": read}
    parts["below_minimum" if 0 < shared < minimum and not read else lost] = shared - read
    parts["expired"] = max(0, ever - shared)
    parts["new"] = n - max(ever, shared)
    return {k: v for k, v in parts.items() if v or k == "cached"}


class PrefixCache:
    """The core model: one trie of earlier prompts per scope (the API key's tenant, or
    prompt_cache_key)."""

    def __init__(self, rules):
        self.rules = rules
        self.tries: dict = {}

    def ttl(self, req) -> float:
        """The lifetime a request's prompt asks for (OpenAI's 24 h retention), else the default."""
        r = self.rules
        return r.long_ttl_seconds if req.long_retention and r.long_ttl_seconds else r.ttl_seconds

    def scope(self, i: int, req, prompt):
        """The trie this request is matched in and joins, and a word on why there ("" by default)."""
        return self.tries.setdefault(req.key, PromptTrie()), ""

    def step(self, i: int, req, prompt) -> Step:
        trie, why = self.scope(i, req, prompt)
        tokens, now = prompt.tokens, req.arrival_s
        trie.ready(now)
        longest, owner = trie.match(tokens, now, self.ttl(req))
        ever = trie.match(tokens, now, math.inf)[0]
        minimum = self.rules.min_for(req.model)
        read = self.rules.cached(longest, minimum)
        if read and owner >= 0:
            trie.touch(owner, now)
        trie.add_when_ready(i, tokens, now, now if req.answer_s is None else req.answer_s)
        written = max(0, self.rules.cached(len(tokens), minimum) - read)
        return Step(longest, read, written, 0, split(len(tokens), read, longest, ever, minimum), why)
