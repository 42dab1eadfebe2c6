"""OpenAI's routing, as its prompt-caching guide documents it (sources in
resources/providers/openai.toml): a request goes to the machine a hash of its first ~256 tokens
plus prompt_cache_key picks; past about `overflow_per_minute` requests a minute for one prefix and
key, the overflow goes to other machines, each with its own (cold) cache. Which of the
`overflow_machines` a request lands on is not documented: here a hash of its position in the
trace, so the simulation is deterministic."""

from __future__ import annotations

import math
from collections import deque
from hashlib import blake2b

from ..trie import PromptTrie
from .core import PrefixCache, Step, split

WINDOW_S = 60.0


class Routing(PrefixCache):
    """The core model with one cache per (scope, machine) and a sliding minute per prefix+key."""

    def __init__(self, rules):
        super().__init__(rules)
        self.windows: dict[tuple, deque] = {}

    def _home(self, req, prompt) -> tuple:
        head = prompt.tokens[:self.rules.routing_prefix_tokens]
        return req.key, blake2b(repr(head).encode(), digest_size=8).digest()

    def scope(self, i: int, req, prompt):
        r = self.rules
        home = self._home(req, prompt)
        window = self.windows.setdefault(home, deque())
        while window and window[0] <= req.arrival_s - WINDOW_S:
            window.popleft()
        window.append(req.arrival_s)
        if not r.overflow_per_minute or not r.overflow_machines or len(window) <= r.overflow_per_minute:
            return self.tries.setdefault((req.key, 0), PromptTrie()), ""
        machine = 1 + int.from_bytes(blake2b(str(i).encode(), digest_size=4).digest()) % r.overflow_machines
        return (self.tries.setdefault((req.key, machine), PromptTrie()),
                f"request {len(window)} in a minute on one prefix and key (past ~{r.overflow_per_minute}): "
                f"routed to overflow machine {machine} of {r.overflow_machines}")

    def step(self, i: int, req, prompt) -> Step:
        s = super().step(i, req, prompt)
        if s.why:  # what the home machine would have read is lost to the overflow
            home = self.tries.setdefault((req.key, 0), PromptTrie())
            tokens, now = prompt.tokens, req.arrival_s
            minimum = self.rules.min_for(req.model)
            home.ready(now)
            longest = home.match(tokens, now, self.ttl(req))[0]
            there = self.rules.cached(longest, minimum)
            if there > s.read:
                s.parts = split(len(tokens), there, longest, home.match(tokens, now, math.inf)[0], minimum)
                s.parts["cached"], s.parts["overflow"] = s.read, there - s.read
        return s
