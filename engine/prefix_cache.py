"""The prefix cache's public calls, the dasLLAMA tutorial's (docs/design.md §3): one line each
over the methods of `PrefixCache` (engine/prefix_store.py, where the semantics are written)."""

from __future__ import annotations

from .block_manager import BlockManager, Session
from .disk_tier import DiskTier
from .eviction import DEFAULT_POLICY
from .prefix_records import ProbeResult
from .prefix_store import (  # the records re-exported here, where the tutorial's callers look
    CacheCounters,
    CachedPage,
    CachedPageInfo,
    CacheEvent,
    ChainRecord,
    HashFn,
    Inserted,
    PrefixCache,
    blake2b_64,
)

__all__ = ["CacheCounters", "CacheEvent", "CachedPage", "CachedPageInfo", "ChainRecord", "Inserted",
           "PrefixCache", "ProbeResult", "blake2b_64", "create_prefix_cache", "prefix_attach",
           "prefix_chain_list", "prefix_held_groups", "prefix_held_pages", "prefix_insert", "prefix_pin",
           "prefix_probe", "prefix_release", "prefix_unpin"]


def create_prefix_cache(max_pages: int = 0, hash_fn: HashFn | None = None,
                        policy: str = DEFAULT_POLICY, disk_pages: int = 0) -> PrefixCache:
    """A prefix cache with a page budget (0: unbounded) and an eviction policy (engine.eviction);
    `disk_pages` > 0 adds a disk tier of that many pages that evicted pages move to;
    `hash_fn` is injectable for tests."""
    tier = DiskTier(disk_pages) if disk_pages else None
    return PrefixCache(max_pages=max_pages, hash_fn=hash_fn, policy=policy, tier=tier)


def prefix_insert(cache: PrefixCache, pool: BlockManager, s: Session, tokens, preview: str = "",
                  namespace: str = "", chain_id: int | None = None) -> Inserted:
    """Donate the session's full pages covering `tokens`; return how many pages were new.

    `chain_id` appends the new pages to that live chain instead of making a new
    record (the scheduler publishes a prompt page by page as prefill computes it);
    a chain that no longer exists is an error. The count is an int whose `.short` says
    how many full pages were left out because pinned pages hold the budget (logged too).
    """
    return cache.insert(pool, s, tokens, preview, namespace, chain_id)


def prefix_attach(cache: PrefixCache, pool: BlockManager, s: Session, prompt, namespace: str = "") -> int:
    """Attach cached pages matching the prompt's start to a fresh session; return tokens matched."""
    return cache.attach(pool, s, prompt, namespace)


def prefix_probe(cache: PrefixCache, prompt, namespace: str = "") -> ProbeResult:
    """Read-only: how far `prompt` would match and why it stops; counts and touches nothing.

    stop_reason: "cap" (the next page is cached, but attach keeps the last token for the
    model), "miss" (no cached page under the next page's key), "token_mismatch" (the key is
    cached but its tokens or parent differ: a hash collision, never attached), "end" (no
    full page left). first_diff_index is the first prompt position not found along the
    cached path (None when every prompt token is); nearest_chain_id is the chain of the
    cached page closest to the prompt there.
    """
    return cache.probe(prompt, namespace)


def prefix_chain_list(cache: PrefixCache) -> list[ChainRecord]:
    """Snapshots (copies) of every chain that still has a live page, oldest first."""
    return cache.chain_list()


def prefix_held_groups(cache: PrefixCache) -> int:
    """How many pool pages the cache holds a reference on."""
    return cache.held_groups()


def prefix_held_pages(cache: PrefixCache) -> list[int]:
    """The pool pages the cache holds a reference on, ascending."""
    return cache.held_pages()


def prefix_release(cache: PrefixCache, pool: BlockManager) -> int:
    """Hand every cached page back to the pool; return how many."""
    return cache.release(pool)


def prefix_pin(cache: PrefixCache, chain_id: int) -> None:
    """Pin a chain: its pages are never evicted and count against the budget."""
    cache.pin(chain_id, True)


def prefix_unpin(cache: PrefixCache, chain_id: int) -> None:
    """Unpin a chain: its pages may be evicted again (at once, if the cache is over budget)."""
    cache.pin(chain_id, False)
