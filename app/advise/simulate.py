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


def _costs(p, n: int, read: int, written: int, written_long: int, o: int) -> tuple[float, float]:
    """(cost without the cache, cost with it) in USD: written tokens at the write price of their lifetime."""
    without = (n * p.input + o * p.output) / 1e6
    with_cache = ((n - read - written) * p.input + read * p.cached_input + (written - written_long)
                  * p.write(False) + written_long * p.write(True) + o * p.output) / 1e6
    return without, with_cache


def simulate(rules: RuleSet, requests, prompts) -> list[Outcome]:
    """Each request's outcome under `rules`; `requests` in arrival order, `prompts[i]` request i's Prompt."""
    cache, out = make(rules), []
    for i, (req, prompt) in enumerate(zip(requests, prompts)):
        s = cache.step(i, req, prompt)
        n, o = len(prompt.tokens), req.output_tokens
        written = s.written + s.written_long
        out.append(Outcome(n, s.common_prefix, s.read, written, o,
                           *_costs(rules.prices, n, s.read, written, s.written_long, o),
                           s.written_long, s.parts, s.why))
    return out


def usage_scale(requests, outcomes: list[Outcome]) -> float | None:
    """The recording's own prompt tokens over the local count, on the requests that reported them
    (None: none did): the factor local counts are scaled by for a provider without a public tokenizer."""
    pairs = [(r.upstream_prompt_tokens, o.prompt_tokens) for r, o in zip(requests, outcomes)
             if r.upstream_prompt_tokens is not None and o.prompt_tokens]
    local = sum(n for _, n in pairs)
    return sum(u for u, _ in pairs) / local if local else None


def scaled(outcomes: list[Outcome], factor: float, rules: RuleSet) -> list[Outcome]:
    """The outcomes in the provider's tokens: every count times `factor`, the costs priced again
    (the minimum and granularity were applied in local tokens)."""
    out = []
    for o in outcomes:
        n, read, written, long = (round(v * factor) for v in (o.prompt_tokens, o.cached_tokens,
                                                              o.written_tokens, o.written_long_tokens))
        written = min(written, n - read)
        parts = {k: round(v * factor) for k, v in o.parts.items()}
        if parts:  # rounding: the largest part absorbs the difference, so they still add up to n
            top = max(parts, key=parts.get)
            parts[top] += n - sum(parts.values())
        out.append(Outcome(n, round(o.common_prefix_tokens * factor), read, written, o.output_tokens,
                           *_costs(rules.prices, n, read, written, min(long, written), o.output_tokens),
                           min(long, written), parts, o.why))
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
