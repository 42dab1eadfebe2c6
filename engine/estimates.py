"""What a cache hit would have cost without the cache, at the session's measured rate (docs/design.md §4)."""

from __future__ import annotations


def ttft_without_cache(queue_wait_s: float, n_prompt: int, prefill_tok_s: float) -> float | None:
    """A request's TTFT had it prefilled its whole prompt: its queue wait plus n_prompt tokens at
    the measured prefill rate (None before any prefill was measured)."""
    if prefill_tok_s <= 0:
        return None
    return float(queue_wait_s) + n_prompt / prefill_tok_s
