"""The functional engine API of docs/design.md §2 (the dasLLAMA tutorial's calls): the model's
and the pool's, then the prefix cache's, one line each over `PrefixCache` (engine/prefix_cache.py,
where their semantics are written)."""

from __future__ import annotations

import numpy as np

from .block_manager import BlockManager
from .disk_tier import DiskTier
from .eviction import DEFAULT_POLICY
from .kv_pool import KVPool, Session
from .loader import Model
from .model import forward
from .prefix_cache import HashFn, PrefixCache
from .prefix_records import ChainRecord, Inserted, ProbeResult


def create_kv_pool(m: Model, page_rows: int = 16, max_pages: int | None = None,
                   kv_dtype: str = "float32") -> KVPool:
    """A KV pool of pages holding `page_rows` positions each; `max_pages=None` grows; `kv_dtype`
    "float16" stores K/V in half the bytes (attention still computes in float32)."""
    return KVPool(m.config, page_rows=page_rows, max_pages=max_pages, kv_dtype=kv_dtype)


def create_session(m: Model, pool: KVPool) -> Session:
    """A fresh session (n_past 0, empty page table) over `pool`."""
    if getattr(pool, "cfg", None) != m.config:
        raise ValueError("this KV pool was made for another model")
    return Session(pool=pool)


def encode(m: Model, text: str) -> list[int]:
    """Token ids of `text`: special tokens parsed, no BOS."""
    return m.tokenizer.encode(text)


def decode(m: Model, ids) -> str:
    """Text of token ids."""
    return m.tokenizer.decode(ids)


def _check_eval(m: Model, s: Session, tokens, pool: KVPool) -> list[int]:
    if s.released:
        raise ValueError(f"session {s.id} was released; create a new session")
    if s.pool is not pool:
        raise ValueError(f"session {s.id} belongs to another KV pool than the batch")
    bad = [t for t in tokens if not isinstance(t, (int, np.integer)) or isinstance(t, bool)]
    if bad:
        raise ValueError(f"token ids must be integers; got {bad[:3]}")
    toks = [int(t) for t in tokens]
    if not toks:
        raise ValueError(f"no tokens to evaluate for session {s.id}")
    bad = [t for t in toks if not 0 <= t < m.config.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{m.config.vocab_size - 1})")
    if s.n_past + len(toks) > m.config.context_length:
        raise ValueError(
            f"session {s.id} would reach {s.n_past + len(toks)} positions, past the model's "
            f"context length {m.config.context_length}")
    return toks


def eval_batch(m: Model, sessions: list[Session], token_lists: list,
               all_positions: bool = False, n_logits: list[int] | None = None,
               prompt: bool | list[bool] | None = None) -> np.ndarray:
    """One forward pass for many sessions; float32[B, vocab] logits after each last token.

    The pool allocates the new tokens' slots first (all or nothing: PoolExhausted changes
    nothing), the forward pass writes their K/V, then the pool records the tokens.
    `all_positions` returns logits after every new token instead (teacher forcing);
    `n_logits` after each session's last `n_logits[i]` tokens, concatenated (speculative decoding).
    `prompt`: which sessions give prompt tokens (a bool for all, or one per session), computed
    as in any prompt pass so a cache hit's tail equals a miss bit for bit (None: those giving
    more than one token; say True for a prompt's one last token after a hit).
    """
    if len(sessions) != len(token_lists) or not sessions:
        raise ValueError("eval_batch needs one token list per session, and at least one session")
    if len({s.id for s in sessions}) != len(sessions):
        raise ValueError("eval_batch got the same session twice")
    pool = sessions[0].pool
    toks = [_check_eval(m, s, t, pool) for s, t in zip(sessions, token_lists)]
    if n_logits is not None and (len(n_logits) != len(toks) or
                                 any(not 1 <= k <= len(t) for k, t in zip(n_logits, toks))):
        raise ValueError("n_logits needs one count per session, each between 1 and its token count")
    slots = pool.allocate(sessions, [len(t) for t in toks])
    logits = forward(m, pool, slots, toks, all_positions, n_logits, prompt)
    pool.commit(sessions, toks)
    return logits


def eval(m: Model, s: Session, tokens, prompt: bool | None = None) -> np.ndarray:  # noqa: A001 - tutorial's name
    """Evaluate tokens on a session; float32[vocab] logits after the last one (`prompt`: eval_batch's)."""
    return eval_batch(m, [s], [tokens], prompt=prompt)[0]


def release_kv_pages(s: Session) -> None:
    """Hand the session's pages back to its pool (a cache over budget evicts at once)."""
    s.pool.free_session(s)


# the prefix cache (docs/design.md §3) ---------------------------------
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
    a chain that no longer exists is an error. The count is an int whose `.left_out_for_pins`
    says how many full pages were left out because pinned pages hold the budget (logged too).
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
