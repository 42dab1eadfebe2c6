"""The cache probe the window shows: how far a prompt would match the cache, and where it differs."""

from __future__ import annotations

import engine
from engine.chat import chat_prompt, turn_messages
from engine.scheduler import Scheduler

PROBE_CONTEXT_TOKENS = 12


def probe_prompt(scheduler: Scheduler, system: str, user: str, namespace: str = "") -> dict:
    """engine.prefix_probe on the scheduler's cache, with the texts the cache panel shows."""
    model, cache = scheduler.model, scheduler.cache
    tok = model.tokenizer
    prompt = chat_prompt(tok, turn_messages(system, user))
    r = engine.prefix_probe(cache, prompt, namespace)
    context, prompt_token, cached_token = departure(tok, prompt, r)
    # Where its tokens would go if it ran now, by the accounting the scheduler's attach uses
    # (docs/design.md §15): the cap's case is the whole rest held by the cache.
    held = (len(prompt), None) if r.stop_reason == "cap" else None
    account, _ = cache.account(prompt, namespace, n_cached=r.matched_pages, held=held)
    return {
        "parts": account.parts.as_dict(), "diverged_at": account.diverged_at,
        "evicted_by": account.evicted_by.describe() if account.evicted_by is not None else None,
        "matched_tokens": r.matched_tokens, "matched_pages": r.matched_pages, "n_prompt": len(prompt),
        "stop_reason": r.stop_reason, "first_diff_index": r.first_diff_index, "chain_id": r.nearest_chain_id,
        "context_before": context, "prompt_token": prompt_token, "cached_token": cached_token,
        "page_rows": scheduler.pool.page_rows, "namespace": namespace,
        "cache_enabled": scheduler.settings.cache_enabled, "user": user,
    }


def departure(tok, prompt: list[int], r) -> tuple[str, str | None, str | None]:
    """A probe's texts: the shared text before its first difference, then the prompt's token and
    the cached one there (both None when the prompt never leaves the cache: the text before
    the end of the match)."""
    d = r.first_diff_index
    if d is not None and d < len(prompt):
        cached = tok.decode([r.cached_token]) if r.cached_token is not None else None
        return tok.decode(prompt[max(0, d - PROBE_CONTEXT_TOKENS):d]), tok.decode([prompt[d]]), cached
    end = r.matched_tokens if d is None else len(prompt)
    return tok.decode(prompt[max(0, end - PROBE_CONTEXT_TOKENS):end]), None, None
