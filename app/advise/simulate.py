"""The hosted-cache simulation of docs/design.md §14, a request at a time: each rule set's named
model (app/advise/providers/) says what a request reads and writes; this prices it."""

from __future__ import annotations

from dataclasses import dataclass, field

from .providers import make
from .rules import RuleSet


@dataclass
class Outcome:
    """One request under one rule set: cached (read) + written + uncached = prompt tokens."""

    prompt_tokens: int
    common_prefix_tokens: int
    cached_tokens: int
    written_tokens: int
    output_tokens: int
    cost_without: float
    cost_with: float
    written_long_tokens: int = 0         # of written_tokens: with the long lifetime (1 h)
    parts: dict = field(default_factory=dict)
    why: str = ""

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens - self.written_tokens


def simulate(rules: RuleSet, requests, prompts) -> list[Outcome]:
    """Each request's outcome under `rules`; `requests` in arrival order, `prompts[i]` request i's Prompt."""
    cache, p, out = make(rules), rules.prices, []
    for i, (req, prompt) in enumerate(zip(requests, prompts)):
        s = cache.step(i, req, prompt)
        n, o = len(prompt.tokens), req.output_tokens
        written = s.written + s.written_long
        without = (n * p.input + o * p.output) / 1e6
        with_cache = ((n - s.read - written) * p.input + s.read * p.cached_input + s.written * p.write(False)
                      + s.written_long * p.write(True) + o * p.output) / 1e6
        out.append(Outcome(n, s.common_prefix, s.read, written, o, without, with_cache, s.written_long,
                           s.parts, s.why))
    return out


def totals(outcomes: list[Outcome]) -> dict:
    """The rule set's totals: requests, tokens, hit ratio, cost without / with the cache, saved, and
    the prompt tokens by cause."""
    prompt = sum(o.prompt_tokens for o in outcomes)
    cached = sum(o.cached_tokens for o in outcomes)
    written = sum(o.written_tokens for o in outcomes)
    without = sum(o.cost_without for o in outcomes)
    with_cache = sum(o.cost_with for o in outcomes)
    parts: dict[str, int] = {}
    for o in outcomes:
        for k, v in o.parts.items():
            parts[k] = parts.get(k, 0) + v
    return {"requests": len(outcomes), "prompt_tokens": prompt, "cached_tokens": cached,
            "cache_read_tokens": cached, "cache_write_tokens": written, "written_tokens": written,
            "uncached_tokens": prompt - cached - written,
            "token_hit_ratio": cached / prompt if prompt else 0.0,
            "cost_without": round(without, 6), "cost_with": round(with_cache, 6),
            "saved": round(without - with_cache, 6), "parts": parts}
