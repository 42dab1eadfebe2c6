"""Cache-friendliness of served traffic: per client, what hit, what was saved, where misses differ.

The engine loop probes each served request just before the scheduler admits it, so
the probe sees the cache exactly as the request's attach did. A miss's first
difference is aggregated by position, with the tokens on both sides, so a user
reads "your prompts differ at token 12: `...T22:41` vs `...T22:42`".
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from ..probe import departure

TOP_POSITIONS = 5


@dataclass
class Departure:
    """Where a prompt left the cached path, with the text on both sides."""

    position: int
    context: str          # the shared text just before the difference
    prompt_token: str     # what this prompt has there
    cached_token: str | None  # what the nearest cached prompt has there


def explain(tokenizer, prompt: list[int], probe) -> Departure | None:
    """The departure point of a probe, as text (None when the prompt never left the cache)."""
    d = probe.first_diff_index if probe is not None else None
    if d is None or d >= len(prompt):
        return None
    return Departure(d, *departure(tokenizer, prompt, probe))


@dataclass
class ClientStats:
    """One client's served requests."""

    requests: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    cold_misses: int = 0   # misses with nothing alike cached (a first request, an evicted prefix)
    misses: Counter = field(default_factory=Counter)        # position -> count
    examples: dict[int, Departure] = field(default_factory=dict)  # position -> latest example

    def to_dict(self) -> dict:
        """The numbers and the most common miss positions, as plain data."""
        total = self.cached_tokens + self.computed_tokens
        top = [{**vars(self.examples[pos]), "count": n} for pos, n in self.misses.most_common(TOP_POSITIONS)]
        return {"requests": self.requests, "hits": self.hits, "prompt_tokens": self.prompt_tokens,
                "prefill_tokens_saved": self.cached_tokens, "prefill_tokens_computed": self.computed_tokens,
                "hit_rate": self.cached_tokens / total if total else 0.0, "cold_misses": self.cold_misses,
                "miss_positions": top}


class Friendliness:
    """Per-client aggregates of served requests; fed by the engine loop, read by any thread."""

    def __init__(self, tokenizer_of=lambda: None):
        self.tokenizer_of = tokenizer_of  # the loaded model's tokenizer, or None
        self._lock = threading.Lock()
        self._clients: dict[str, ClientStats] = {}

    def observe(self, job, finish) -> None:
        """Engine-loop observer: one finished served request (engine thread)."""
        r = finish.record
        tokenizer = self.tokenizer_of()
        departure = explain(tokenizer, job.prompt, job.probe) if tokenizer and job.prompt else None
        if departure is not None and r.n_cached > departure.position:
            departure = None  # a stream prefilling the same prefix made it a hit after the probe
        with self._lock:
            c = self._clients.setdefault(job.client or "unknown", ClientStats())
            c.requests += 1
            c.hits += r.n_cached > 0
            c.prompt_tokens += r.n_prompt
            c.cached_tokens += r.n_cached
            c.computed_tokens += r.n_prefilled
            if departure is not None and departure.cached_token is None:
                c.cold_misses += 1
            elif departure is not None:
                c.misses[departure.position] += 1
                c.examples[departure.position] = departure

    def to_dict(self) -> dict:
        """Every client's numbers, most requests first."""
        with self._lock:
            clients = sorted(self._clients.items(), key=lambda kv: -kv[1].requests)
            return {"clients": [{"client": name, **stats.to_dict()} for name, stats in clients]}
