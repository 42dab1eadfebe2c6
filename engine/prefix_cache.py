"""A page-granular prefix cache over a KVPool, ported from dasLLAMA.

Page i of a prompt is keyed by a chained hash of page i-1's key and page i's
tokens (the namespace salts page 0), so equal keys mean equal prefixes. Hashes
route, tokens verify: a hit is accepted only when the stored tokens, parent and
namespace equal the prompt's. The cache holds one pool reference per page.

Eviction gives back pages that no session holds, in the order of a pluggable
policy (engine/eviction.py). The default, leaf-LRU, takes the least recently
used leaf (a page with no cached child): the deepest page of a chain goes first
and no cached page is ever stranded behind an evicted head.

A cache made with `id_keys=True` (the replay of hash-id traces) keys each page
by an id the caller passes in place of its tokens: one id per page (page_rows 1),
already chained like Mooncake's block hashes, so nothing is hashed and the page
stores and indexes no tokens; the same attach and insert calls drive it.

The cache works over any BlockManager (a KVPool, or a bare manager with no K/V
storage, as the trace replay uses): it only moves page ids and references.
Listeners (`add_listener`) hear every change: pages stored, removed, or all cleared.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import struct
import time
from collections.abc import Callable

from .block_manager import BlockManager, Session
from .eviction import DEFAULT_POLICY, EvictionPolicy, make_policy
from .prefix_records import (
    CacheCounters,
    CachedPage,
    CachedPageInfo,
    CacheEvent,
    ChainRecord,
    ProbeResult,
)

__all__ = ["CacheCounters", "CacheEvent", "CachedPage", "CachedPageInfo", "ChainRecord", "PrefixCache",
           "ProbeResult", "blake2b_64", "create_prefix_cache", "prefix_attach", "prefix_chain_list",
           "prefix_held_groups", "prefix_held_pages", "prefix_insert", "prefix_probe", "prefix_release"]

HashFn = Callable[[bytes], int]


def blake2b_64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _info(entry: CachedPage) -> CachedPageInfo:
    return CachedPageInfo(entry.key, entry.parent, entry.tokens, entry.namespace)


class _Trie:
    """The tokens of sibling pages (one parent), so a probe finds the nearest in O(page_rows)."""

    __slots__ = ("n", "next", "key")

    def __init__(self):
        self.n = 0                        # sibling pages whose tokens pass through this node
        self.next: dict[int, _Trie] = {}
        self.key: int | None = None       # the page whose tokens end here


class PrefixCache:
    """Cached pages by chained key, chain records, and an eviction policy (default leaf-LRU)."""

    def __init__(self, max_pages: int = 0, hash_fn: HashFn | None = None,
                 policy: str | EvictionPolicy = DEFAULT_POLICY, id_keys: bool = False):
        if not isinstance(max_pages, int) or max_pages < 0:
            raise ValueError(f"max_pages must be an integer >= 0 (0: unbounded), got {max_pages!r}")
        self.max_pages = max_pages
        self.id_keys = id_keys
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.hash_fn = hash_fn or blake2b_64
        self.pages: dict[int, CachedPage] = {}
        self.roots: dict[str, set[int]] = {}
        self.chains: dict[int, ChainRecord] = {}
        self.counters = CacheCounters()
        self.page_rows: int | None = None
        self.pool: BlockManager | None = None
        self._clock = itertools.count(1)
        self._chain_ids = itertools.count(1)
        self._births = itertools.count(1)
        self.by_page: dict[int, int] = {}            # pool page -> key
        self.siblings: dict[tuple[str, int | None], _Trie] = {}  # (namespace, parent) -> tokens
        self.listeners: list[Callable[[CacheEvent], None]] = []

    # listeners --------------------------------------------------------
    def add_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        """Call `fn(event)` with a CacheEvent after every change (in the engine's thread)."""
        self.listeners.append(fn)

    def remove_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        self.listeners.remove(fn)

    def _emit(self, kind: str, entries=()) -> None:
        if self.listeners:
            event = CacheEvent(kind, tuple(_info(e) for e in entries))
            for fn in list(self.listeners):
                fn(event)

    # keys -------------------------------------------------------------
    def page_key(self, parent: int | None, tokens, namespace: str) -> int:
        if self.id_keys:
            return tokens[0]  # the page's own (already chained) id
        if parent is None:
            salt = b"ns:" + namespace.encode("utf-8") + b"\0"
        else:
            salt = parent.to_bytes(8, "little")
        return self.hash_fn(salt + struct.pack(f"<{len(tokens)}q", *tokens))  # int64 LE

    def verify(self, entry: CachedPage, parent: int | None, tokens, namespace: str) -> bool:
        # An id-keyed page has no tokens: its id is its whole prefix (chained by the trace).
        return (entry.parent == parent and entry.namespace == namespace
                and (self.id_keys or entry.tokens == tuple(tokens)))

    # recency ----------------------------------------------------------
    def touch(self, entry: CachedPage) -> None:
        entry.last_used = next(self._clock)
        entry.uses += 1
        self.policy.touched(entry, self.pages)

    def bind(self, pool: BlockManager) -> None:
        if self.id_keys and pool.page_rows != 1:
            raise ValueError(f"an id-keyed cache needs one id per page (page_rows 1), got {pool.page_rows}")
        if self.pool is None:
            self.pool, self.page_rows = pool, pool.page_rows
            pool.add_cache(self)
        elif self.pool is not pool:
            raise ValueError("this prefix cache belongs to another KV pool")

    # eviction ---------------------------------------------------------
    def _unheld(self, entry: CachedPage) -> bool:
        return self.pool.refs[entry.page] == 1  # only the cache's own reference

    def evict(self, n: int) -> int:
        """Give back up to n pages no session holds, in the policy's order; return how many."""
        removed: list[CachedPage] = []

        def remove(entry: CachedPage) -> None:
            self._remove(entry)
            removed.append(entry)
        self.policy.evict(n, self.pages, self._unheld, remove)
        if removed:
            self._emit("removed", removed)
        return len(removed)

    def link(self, entry: CachedPage) -> None:
        """Add a new page to the tree: its parent's children (or the roots) and the sibling trie."""
        entry.born = next(self._births)
        if entry.parent is None:
            self.roots.setdefault(entry.namespace, set()).add(entry.key)
        else:
            self.pages[entry.parent].children.add(entry.key)
        self.policy.added(entry)
        if self.id_keys:
            return  # keyed by a given id: no tokens to index for probes
        node = self.siblings.setdefault((entry.namespace, entry.parent), _Trie())
        node.n += 1
        for t in entry.tokens:
            node = node.next.setdefault(t, _Trie())
            node.n += 1
        node.key = entry.key

    def _unindex(self, entry: CachedPage) -> None:
        if self.id_keys:
            return
        slot = (entry.namespace, entry.parent)
        node = self.siblings[slot]
        node.n -= 1
        if node.n == 0:
            del self.siblings[slot]
            return
        for t in entry.tokens:
            child = node.next[t]
            child.n -= 1
            if child.n == 0:
                del node.next[t]
                return
            node = child

    def _remove(self, entry: CachedPage) -> None:
        del self.pages[entry.key]
        del self.by_page[entry.page]
        self._unindex(entry)
        if entry.parent is None:
            self.roots[entry.namespace].discard(entry.key)
        else:
            # A policy that evicts inner pages (plain LRU) can leave this page's parent
            # gone already; its own cached children then stay, stranded, until the
            # parent's key is inserted again.
            parent = self.pages.get(entry.parent)
            if parent is not None:
                parent.children.discard(entry.key)
                if not parent.children:
                    self.policy.became_leaf(parent)
        chain = self.chains[entry.chain_id]
        chain.pages_live -= 1
        if chain.pages_live == 0:
            del self.chains[entry.chain_id]
        self.counters.evicted_pages += 1
        self.pool.release(entry.page)

    def num_evictable(self) -> int:
        """Cached pages eviction can give back, now or once their children went: pages that
        no session holds, with no session holding a page below them. O(cached pages)."""
        blocked: set[int] = set()
        for entry in sorted(self.pages.values(), key=lambda e: -e.depth):  # children first
            if entry.key in blocked or self.pool.refs[entry.page] > 1:
                blocked.add(entry.key)
                if entry.parent is not None:
                    blocked.add(entry.parent)
        return len(self.pages) - len(blocked)

    def enforce_budget(self) -> None:
        """Evict down to the budget as far as pages can be given back (after inserts and releases)."""
        if self.max_pages and len(self.pages) > self.max_pages:
            self.evict(len(self.pages) - self.max_pages)

    # queries ----------------------------------------------------------
    def walk(self, prompt, namespace: str, limit_pages: int):
        """Yield (index, key, entry or None, verified) page by page until a miss."""
        rows = self.page_rows
        parent = None
        for i in range(limit_pages):
            toks = prompt[i * rows:(i + 1) * rows]
            key = self.page_key(parent, toks, namespace)
            entry = self.pages.get(key)
            ok = entry is not None and self.verify(entry, parent, toks, namespace)
            yield i, key, entry, ok
            if not ok:
                return
            parent = key

    def nearest(self, parent: int | None, namespace: str, toks) -> tuple[int, CachedPage | None]:
        """Longest common prefix of `toks` with any cached child of `parent`, and that page."""
        node = self.siblings.get((namespace, parent))
        if node is None:
            return 0, None
        n = 0
        for t in toks:
            child = node.next.get(int(t))
            if child is None:
                break
            node, n = child, n + 1
        while node.key is None:  # any page below this node shares those n tokens
            node = next(iter(node.next.values()))
        return n, self.pages[node.key]


def create_prefix_cache(max_pages: int = 0, hash_fn: HashFn | None = None,
                        policy: str = DEFAULT_POLICY) -> PrefixCache:
    """A prefix cache with a page budget (0: unbounded) and an eviction policy (engine.eviction);
    `hash_fn` is injectable for tests."""
    return PrefixCache(max_pages=max_pages, hash_fn=hash_fn, policy=policy)


def _check_session(pool: BlockManager, s: Session) -> None:
    if s.released:
        raise ValueError(f"session {s.id} was released; create a new session")
    if s.pool is not pool:
        raise ValueError(f"session {s.id} belongs to another KV pool")


def prefix_insert(cache: PrefixCache, pool: BlockManager, s: Session, tokens, preview: str = "",
                  namespace: str = "", chain_id: int | None = None) -> int:
    """Donate the session's full pages covering `tokens`; return how many pages were new.

    `chain_id` appends the new pages to that live chain instead of making a new
    record (the scheduler publishes a prompt page by page as prefill computes it);
    a chain that no longer exists is an error.
    """
    _check_session(pool, s)
    if chain_id is not None and chain_id not in cache.chains:
        raise ValueError(f"chain {chain_id} does not exist in this prefix cache "
                         f"(its pages were evicted or released)")
    cache.bind(pool)
    rows = pool.page_rows
    evaluated, table = pool.tokens(s), pool.table(s)
    covered = min(len(tokens), len(evaluated))
    if list(tokens[:covered]) != evaluated[:covered]:
        first = next((i for i, (a, b) in enumerate(zip(tokens, evaluated, strict=False)) if a != b),
                     min(len(evaluated), covered))
        raise ValueError(
            f"tokens differ from what session {s.id} evaluated, first at position {first}")
    chain: ChainRecord | None = cache.chains.get(chain_id) if chain_id is not None else None
    parent: int | None = None
    path: list[CachedPage] = []
    new: list[CachedPage] = []
    for i in range(covered // rows):
        toks = tuple(map(int, tokens[i * rows:(i + 1) * rows]))
        key = cache.page_key(parent, toks, namespace)
        entry = cache.pages.get(key)
        if entry is not None:
            if not cache.verify(entry, parent, toks, namespace):
                break  # a hash collision: never store under another prefix's key
            path.append(entry)
            parent = key
            continue
        page = table[i]
        if page in cache.by_page:
            break  # this pool page already caches another prefix (e.g. another namespace)
        if chain is None:
            chain = ChainRecord(id=next(cache._chain_ids), n_tokens=0, pages_live=0, hits=0,
                                preview=preview, created_at=time.time(), namespace=namespace,
                                first_page_depth=i)
            cache.chains[chain.id] = chain
        pool.retain(page)
        # Positional: half the cost of keywords, once per new page (a replay makes ~10^5).
        entry = CachedPage(key, page, () if cache.id_keys else toks, parent, namespace, i, chain.id)
        cache.pages[key] = entry
        cache.by_page[page] = key
        cache.link(entry)
        path.append(entry)
        new.append(entry)
        chain.n_tokens += rows
        chain.pages_live += 1
        parent = key
    # Touch root to leaf once the links exist: parents stay older than their children
    # and only the path's leaf enters the LRU heap (no stale entry per inner page).
    for entry in path:
        cache.touch(entry)
    cache.counters.inserted_pages += len(new)
    if new:
        cache._emit("stored", new)
    cache.enforce_budget()
    return len(new)


def prefix_attach(cache: PrefixCache, pool: BlockManager, s: Session, prompt, namespace: str = "") -> int:
    """Attach cached pages matching the prompt's start to a fresh session; return tokens matched."""
    _check_session(pool, s)
    pool.check_fresh(s)
    if cache.pool is not None and cache.pool is not pool:
        raise ValueError("this prefix cache belongs to another KV pool")
    cache.counters.queries += 1
    if cache.pool is None:
        return 0
    rows = pool.page_rows
    cap = max(0, (len(prompt) - 1) // rows)
    matched: list[CachedPage] = []
    for _, _, entry, ok in cache.walk(prompt, namespace, cap):
        if not ok:
            break
        matched.append(entry)
    n = len(matched) * rows
    pool.attach(s, [e.page for e in matched], prompt[:n])
    for entry in matched:
        cache.touch(entry)
    if matched:
        chain = cache.chains[matched[-1].chain_id]
        chain.hits += 1
        chain.last_hit_at = time.time()
        cache.counters.hits += 1
        cache.counters.hit_pages += len(matched)
        cache.counters.tokens_saved += n
    return n


def prefix_probe(cache: PrefixCache, prompt, namespace: str = "") -> ProbeResult:
    """Read-only: how far `prompt` would match and why it stops; counts and touches nothing.

    stop_reason: "cap" (the next page is cached, but attach keeps the last token for the
    model), "miss" (no cached page under the next page's key), "token_mismatch" (the key is
    cached but its tokens or parent differ: a hash collision, never attached), "end" (no
    full page left). first_diff_index is the first prompt position not found along the
    cached path (None when every prompt token is); nearest_chain_id is the chain of the
    cached page closest to the prompt there.
    """
    if len(prompt) == 0:
        return ProbeResult(0, 0, "end", None, None)
    if cache.pool is None:
        return ProbeResult(0, 0, "miss", 0, None)  # nothing was ever cached
    rows = cache.page_rows
    cap = max(0, (len(prompt) - 1) // rows)
    n_full = len(prompt) // rows
    matched, parent, last_chain = 0, None, None
    for i, key, entry, ok in cache.walk(prompt, namespace, n_full):
        if ok and i < cap:
            matched, parent, last_chain = i + 1, key, entry.chain_id
            continue
        if ok:  # the cache holds this page but the cap keeps one token for the model
            return ProbeResult(matched * rows, matched, "cap", None, entry.chain_id)
        toks = [int(t) for t in prompt[i * rows:(i + 1) * rows]]
        lcp, near = cache.nearest(parent, namespace, toks)
        reason = "token_mismatch" if entry is not None else "miss"
        return _departure(matched, rows, reason, i * rows + lcp, lcp, near, last_chain)
    # Out of full pages: the rest of the prompt is a partial page (never attached).
    tail = [int(t) for t in prompt[matched * rows:]]
    lcp, near = cache.nearest(parent, namespace, tail)
    diff = None if lcp == len(tail) else matched * rows + lcp
    return _departure(matched, rows, "end", diff, lcp, near, last_chain)


def _departure(matched: int, rows: int, reason: str, diff: int | None, lcp: int,
               near: CachedPage | None, last_chain: int | None) -> ProbeResult:
    """A probe that leaves the cached path: where, and what the nearest cached page holds there."""
    cached = near.tokens[lcp] if near is not None and diff is not None and lcp < len(near.tokens) else None
    return ProbeResult(matched * rows, matched, reason, diff, near.chain_id if near else last_chain, cached)


def prefix_chain_list(cache: PrefixCache) -> list[ChainRecord]:
    """Snapshots (copies) of every chain that still has a live page, oldest first."""
    return [copy.copy(c) for c in cache.chains.values() if c.pages_live > 0]


def prefix_held_groups(cache: PrefixCache) -> int:
    """How many pool pages the cache holds a reference on."""
    return len(cache.by_page)


def prefix_held_pages(cache: PrefixCache) -> list[int]:
    """The pool pages the cache holds a reference on, ascending."""
    return sorted(cache.by_page)


def prefix_release(cache: PrefixCache, pool: BlockManager) -> int:
    """Hand every cached page back to the pool; return how many."""
    if cache.pool is not None and cache.pool is not pool:
        raise ValueError("this prefix cache belongs to another KV pool")
    n = len(cache.pages)
    for entry in cache.pages.values():
        pool.release(entry.page)
    cache.pages.clear()
    cache.by_page.clear()
    cache.roots.clear()
    cache.siblings.clear()
    cache.chains.clear()
    cache.policy.clear()
    cache._emit("cleared")
    return n
