"""What a cache hit would have cost without the cache, at the session's measured rate (docs/design.md §4)."""

from __future__ import annotations


def ttft_without_cache(ttft_s: float, n_cached: int, prefill_tok_s: float) -> float | None:
    """A hit's TTFT had it computed its cached tokens too: its measured TTFT plus n_cached tokens
    at the measured prefill rate (None before any prefill was measured). Measured from its own
    TTFT, not from its queue wait plus its whole prompt: a hit that joined another request's
    pass (docs/design.md §4) waited for that pass, and would have without the cache as well."""
    if prefill_tok_s <= 0:
        return None
    return float(ttft_s) + n_cached / prefill_tok_s
