"""DeepSeek's cache prefix units, as its context-caching guide documents them (sources in
resources/providers/deepseek.toml): a hit needs a WHOLE stored unit. Each request stores a unit at
the end of its input (the whole prompt; the end of the model's output is the next turn's prompt
and is not known here), at the common prefix the system detects with an earlier request, and
every `unit_interval_tokens` of a long input. A request reads the longest stored unit its prompt
starts with that is still alive; a read refreshes it."""

from __future__ import annotations

import math

from .core import PrefixCache, Step, prefix_digests, split


class Units(PrefixCache):
    """Stored units per scope by the digest of their tokens, with their expiry."""

    def __init__(self, rules):
        super().__init__(rules)
        self.units: dict[str, dict[bytes, tuple[float, float]]] = {}  # digest -> (expires, readable after)
        self.lengths: dict[str, set[int]] = {}

    def step(self, i: int, req, prompt) -> Step:
        r, tokens, now = self.rules, prompt.tokens, req.arrival_s
        n, ttl, minimum = len(tokens), self.ttl(req), r.min_for(req.model)
        trie, _ = self.scope(i, req, prompt)
        trie.ready(now)
        longest = trie.match(tokens, now, ttl)[0]
        ever = trie.match(tokens, now, math.inf)[0]
        trie.add_when_ready(i, tokens, now, now if req.answer_s is None else req.answer_s)
        units, lengths = self.units.setdefault(req.key, {}), self.lengths.setdefault(req.key, set())
        step = r.unit_interval_tokens
        new = {n, longest} | (set(range(step, n + 1, step)) if step else set())
        new = {b for b in new if b >= max(1, minimum)}
        digests = prefix_digests(tokens, sorted({b for b in lengths if b <= longest} | new))
        read, never = 0, (-math.inf, math.inf)
        for b in sorted((b for b in lengths if b <= longest), reverse=True):
            expires, ready = units.get(digests[b], never)
            if now <= expires and ready < now:
                read = b
                units[digests[b]] = (now + ttl, ready)
                break
        began = now if req.answer_s is None else req.answer_s  # a unit is stored once the answer began
        for b in new:
            expires, ready = units.get(digests[b], never)
            units[digests[b]] = (max(expires, now + ttl), min(ready, began))
            lengths.add(b)
        parts = split(n, read, longest, ever, minimum, lost="rounding")
        return Step(longest, read, 0, 0, parts, "")
