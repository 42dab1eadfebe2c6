"""Cache-friendliness of served traffic: per client, what hit, what was saved, where misses differ.

`AdmissionProbe`, an engine-loop observer the server registers, probes each served request
while it waits in the scheduler's queue, so the last probe before admission sees the cache
exactly as the request's attach did. A miss's first
difference is aggregated by position, with the tokens on both sides, so a user
reads "your prompts differ at token 12: `...T22:41` vs `...T22:42`".
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

import engine
from engine.metrics import hit_rate

from ..probe import departure

TOP_POSITIONS = 5
MAX_CLIENTS = 200  # per tenant; later new clients are counted together, so memory stays bounded
OTHERS = "(other clients)"


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
        top = [{**vars(self.examples[pos]), "count": n} for pos, n in self.misses.most_common(TOP_POSITIONS)]
        return {"requests": self.requests, "hits": self.hits, "prompt_tokens": self.prompt_tokens,
                "prefill_tokens_saved": self.cached_tokens, "prefill_tokens_computed": self.computed_tokens,
                "hit_rate": hit_rate(self.cached_tokens, self.computed_tokens),
                "cold_misses": self.cold_misses, "miss_positions": top}


class AdmissionProbe:
    """An engine-loop observer (owner thread, after each drain): probes each served job's queued
    prompt again whenever the cache changed since its last probe; `take` hands the last one over
    when the job ends."""

    def __init__(self):
        self._probes: dict[int, tuple[object, tuple[int, int]]] = {}  # ticket -> (probe, cache stamp)

    def __call__(self, loop) -> None:
        s = loop.scheduler
        if s is None:
            return
        c = s.cache.counters
        stamp = (c.inserted_pages, c.evicted_pages)
        for job, prompt, namespace in loop.queued():
            last = self._probes.get(job.ticket)
            if job.client and (last is None or last[1] != stamp):
                self._probes[job.ticket] = (engine.prefix_probe(s.cache, prompt, namespace), stamp)

    def take(self, ticket: int):
        """The job's last probe before admission (None: never probed), forgotten here."""
        last = self._probes.pop(ticket, None)
        return last[0] if last is not None else None


class Friendliness:
    """Per-client aggregates of served requests; fed by the engine loop, read by any thread."""

    def __init__(self, tokenizer_of=lambda: None):
        self.tokenizer_of = tokenizer_of  # the loaded model's tokenizer, or None
        self._lock = threading.Lock()
        self._clients: dict[tuple[str, str], ClientStats] = {}  # (tenant, client label) -> stats

    def observe(self, job, finish, probe) -> None:
        """One finished served request and its last probe before admission (engine thread)."""
        r = finish.record
        tokenizer = self.tokenizer_of()
        departure = explain(tokenizer, job.prompt, probe) if tokenizer and job.prompt else None
        if departure is not None and r.n_cached > departure.position:
            departure = None  # a stream prefilling the same prefix made it a hit after the probe
        with self._lock:
            c = self._stats_of(job.tenant, job.client or "unknown")
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

    def _stats_of(self, tenant: str, client: str) -> ClientStats:
        key = (tenant, client)
        if key not in self._clients and sum(t == tenant for t, _ in self._clients) >= MAX_CLIENTS:
            key = (tenant, OTHERS)
        return self._clients.setdefault(key, ClientStats())

    def to_dict(self, tenant: str | None = None) -> dict:
        """Every client's numbers, most requests first; with `tenant`, that tenant's clients only."""
        with self._lock:
            clients = sorted(((c, stats) for (t, c), stats in self._clients.items()
                              if tenant is None or t == tenant), key=lambda kv: -kv[1].requests)
            return {"clients": [{"client": name, **stats.to_dict()} for name, stats in clients]}
