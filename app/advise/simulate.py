"""The exact hosted-cache simulation of docs/design.md §14, a request at a time.

Per routing key, every earlier prompt sits in a token trie whose nodes keep the latest
last-use of any prompt through them (and which prompt that was), so the longest common
prefix with a prompt still alive (last use at most ttl_seconds ago) is one walk.
"""

from __future__ import annotations

from dataclasses import dataclass

from .rules import RuleSet


class _Node:
    __slots__ = ("children", "last", "owner")

    def __init__(self):
        self.children: dict[int, _Node] = {}
        self.last = float("-inf")
        self.owner = -1


class PromptTrie:
    """Earlier prompts of one routing key, with their last uses."""

    def __init__(self):
        self.root = _Node()
        self.prompts: dict[int, list[int]] = {}

    def match(self, tokens: list[int], now: float, ttl: float) -> tuple[int, int]:
        """(L, the prompt matched): the longest common prefix with a prompt used at most `ttl`
        seconds before `now`; the prompt is the most recently used one sharing those L tokens."""
        node, depth = self.root, 0
        for t in tokens:
            child = node.children.get(t)
            if child is None or now - child.last > ttl:
                break
            node, depth = child, depth + 1
        return depth, node.owner

    def touch(self, pid: int, now: float) -> None:
        """Prompt `pid` was used at `now` (a hit refreshes the whole prompt it matched)."""
        self._walk(self.prompts[pid], pid, now)

    def add(self, pid: int, tokens: list[int], now: float) -> None:
        """Prompt `pid` joins the cache, last used at `now`."""
        self.prompts[pid] = tokens
        self._walk(tokens, pid, now)

    def _walk(self, tokens: list[int], pid: int, now: float) -> None:
        node = self.root
        for t in tokens:
            child = node.children.get(t)
            if child is None:
                child = node.children[t] = _Node()
            node = child
            node.last, node.owner = now, pid


@dataclass
class Outcome:
    """One request under one rule set."""

    prompt_tokens: int
    common_prefix_tokens: int
    cached_tokens: int
    written_tokens: int
    output_tokens: int
    cost_without: float
    cost_with: float


def simulate(rules: RuleSet, requests, prompts) -> list[Outcome]:
    """Each request's outcome under `rules`; `requests` in arrival order, `prompts[i]` request i's Prompt."""
    tries: dict[str, PromptTrie] = {}
    p = rules.prices
    out = []
    for i, (req, prompt) in enumerate(zip(requests, prompts)):
        trie = tries.setdefault(req.key, PromptTrie())
        tokens = prompt.tokens
        longest, owner = trie.match(tokens, req.arrival_s, rules.ttl_seconds)
        if rules.breakpoints:  # only a prefix ending at one of this request's marks is cached
            longest = max((m for m in prompt.marks if m <= longest), default=0)
        cached = rules.cached(longest)
        if cached and owner >= 0:
            trie.touch(owner, req.arrival_s)
        trie.add(i, tokens, req.arrival_s)
        cacheable = (prompt.marks[-1] if prompt.marks else 0) if rules.breakpoints else len(tokens)
        written = max(0, rules.cached(cacheable) - cached)
        n, o = len(tokens), req.output_tokens
        without = (n * p.input + o * p.output) / 1e6
        with_cache = ((n - cached) * p.input + cached * p.cached_input + written * (p.cache_write - p.input)
                      + o * p.output) / 1e6
        out.append(Outcome(n, longest, cached, written, o, without, with_cache))
    return out


def totals(outcomes: list[Outcome]) -> dict:
    """The rule set's totals: requests, tokens, hit ratio, cost without / with the cache, saved."""
    prompt = sum(o.prompt_tokens for o in outcomes)
    cached = sum(o.cached_tokens for o in outcomes)
    without = sum(o.cost_without for o in outcomes)
    with_cache = sum(o.cost_with for o in outcomes)
    return {"requests": len(outcomes), "prompt_tokens": prompt, "cached_tokens": cached,
            "written_tokens": sum(o.written_tokens for o in outcomes),
            "token_hit_ratio": cached / prompt if prompt else 0.0,
            "cost_without": round(without, 6), "cost_with": round(with_cache, 6),
            "saved": round(without - with_cache, 6)}
