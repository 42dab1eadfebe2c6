"""The prefix cache (a page-granular one over a KVPool, ported from dasLLAMA): `PrefixCache`,
the one class that owns chains and keys.

Page i of a prompt is keyed by a chained hash of page i-1's key and page i's
tokens (the namespace salts page 0), so equal keys mean equal prefixes. Hashes
route, tokens verify: a hit is accepted only when the stored tokens, parent and
namespace equal the prompt's. The cache holds one pool reference per page.

Eviction gives back pages that no session holds and no pin keeps, in the order of
a pluggable policy (engine/eviction.py). The default, leaf-LRU, takes the least
recently used leaf (a page with no cached child): the deepest page of a chain goes
first and no cached page is ever stranded behind an evicted head. The cache binds
itself to its pool as the pool's evictor: a bounded pool out of pages asks it to
give some back, and a released session lets it return to its budget.

A cache made with `id_keys=True` (the replay of hash-id traces) keys each page
by an id the caller passes in place of its tokens: one id per page (page_rows 1),
already chained like Mooncake's block hashes, so nothing is hashed and the page
stores and indexes no tokens; the same attach and insert calls drive it.

The cache works over any BlockManager (a KVPool, or a bare manager with no K/V
storage, as the trace replay uses): it only moves page ids and references, and reads
the pool only through its public calls. An optional disk tier (engine/disk_tier.py)
takes pages about to be evicted and gives them back to an attach that walks past the
pool's pages. The tutorial's free functions (`prefix_insert`, ...) are one-line wrappers
in engine/api.py. Listeners (`add_listener`) hear every change: pages stored, removed,
or all cleared.

Every attach can also say where each prompt token went (`attach_accounted`, docs/design.md §15):
the same walk goes on past the attached pages through an ever-seen index (engine/token_parts.py)
that the cache feeds as pages are cached and evicted.

Reading order: keys; the tutorial's operations (insert, attach, probe, release); where every
token went; pins; eviction; the tree of cached pages and its sibling index; the disk tier's
moves; saved pages adopted back.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import logging
import struct
import time
from collections.abc import Callable, Iterator

from .block_manager import BlockManager, Session, attach_cap
from .disk_tier import DiskTier
from .eviction import DEFAULT_POLICY, EvictionPolicy, make_policy
from .prefix_records import (
    CacheCounters,
    CachedPage,
    CachedPageInfo,
    CacheEvent,
    ChainRecord,
    Inserted,
    ProbeResult,
)
from .token_parts import SEEN_PAGES, Account, Eviction, SeenIndex, TokenParts

HashFn = Callable[[bytes], int]
log = logging.getLogger("prefixlab.cache")


def blake2b_64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _info(entry: CachedPage) -> CachedPageInfo:
    return CachedPageInfo(entry.key, entry.parent, entry.tokens, entry.namespace)


def _check_session(pool: BlockManager, s: Session) -> None:
    if s.released:
        raise ValueError(f"session {s.id} was released; create a new session")
    if s.pool is not pool:
        raise ValueError(f"session {s.id} belongs to another KV pool")


class _Trie:
    """The tokens of sibling pages (one parent), so a probe finds the nearest in O(page_rows)."""

    __slots__ = ("n", "next", "key")

    def __init__(self):
        self.n = 0                        # sibling pages whose tokens pass through this node
        self.next: dict[int, _Trie] = {}
        self.key: int | None = None       # the page whose tokens end here


class PrefixCache:
    """Cached pages by chained key, chain records, pins, an eviction policy (default leaf-LRU),
    the sibling index a probe reads, and an optional disk tier that evicted pages move to."""

    def __init__(self, max_pages: int = 0, hash_fn: HashFn | None = None,
                 policy: str | EvictionPolicy = DEFAULT_POLICY, id_keys: bool = False,
                 tier: DiskTier | None = None, seen_pages: int = SEEN_PAGES):
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
        self.by_page: dict[int, int] = {}                        # pool page -> key
        self.siblings: dict[tuple[str, int | None], _Trie] = {}  # (namespace, parent) -> children's tokens
        self.listeners: list[Callable[[CacheEvent], None]] = []
        self.tier = tier
        # Every page ever cached, within reach, so an attach can say where each token went
        # (docs/design.md §15); `actor` is the request the caller is working for now (None:
        # none), named by the evictions it causes.
        self.seen = SeenIndex(seen_pages)
        self.actor: int | None = None
        self._cause = "flush"
        self._pin_changes = 0   # pins change what is evictable without a page changing
        self._evictable: tuple = (None, 0)   # (the state it was counted in, num_evictable)

    # listeners --------------------------------------------------------
    def add_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        """Call `fn(event)` with a CacheEvent after every change (in the engine's thread)."""
        self.listeners.append(fn)

    def remove_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        self.listeners.remove(fn)

    def _emit(self, kind: str, entries=(), medium: str = "GPU") -> None:
        # medium, vLLM's word: "GPU" for pool pages (the fast tier), "CPU" for the disk tier
        if self.listeners:
            event = CacheEvent(kind, tuple(_info(e) for e in entries), medium)
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

    def free_key(self, parent_free: int | None, tokens) -> int:
        """A page's key in the default namespace: the ever-seen index's key, the same for every
        namespace that holds these tokens at this place."""
        return self.page_key(parent_free, tokens, "")

    def verify(self, entry: CachedPage, parent: int | None, tokens, namespace: str) -> bool:
        # An id-keyed page has no tokens: its id is its whole prefix (chained by the trace).
        return (entry.parent == parent and entry.namespace == namespace
                and (self.id_keys or entry.tokens == tuple(tokens)))

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

    def chain_of(self, page: int) -> int | None:
        """The chain owning pool page `page`, or None when the cache does not hold it."""
        key = self.by_page.get(page)
        return None if key is None else self.pages[key].chain_id

    def entries(self) -> list[CachedPage]:
        """Every cached page (a list: callers may evict while reading)."""
        return list(self.pages.values())

    # the pool ---------------------------------------------------------
    def bind(self, pool: BlockManager) -> None:
        """Belong to `pool` (once): become its evictor, and size the disk tier's file for its pages."""
        if self.id_keys and pool.page_rows != 1:
            raise ValueError(f"an id-keyed cache needs one id per page (page_rows 1), got {pool.page_rows}")
        if self.pool is None:
            pool.bind_evictor(self.give_back)
            self.pool, self.page_rows = pool, pool.page_rows
            if self.tier is not None:
                self.tier.bind(pool)
        elif self.pool is not pool:
            raise ValueError("this prefix cache belongs to another KV pool")

    def _check_pool(self, pool: BlockManager) -> None:
        if self.pool is not None and self.pool is not pool:
            raise ValueError("this prefix cache belongs to another KV pool")

    # the tutorial's operations ----------------------------------------
    def insert(self, pool: BlockManager, s: Session, tokens, preview: str = "", namespace: str = "",
               chain_id: int | None = None, known: list[CachedPage] = ()) -> Inserted:
        """`prefix_insert` (engine/api.py): donate the session's full pages covering `tokens`.

        `known`: the `.path` an earlier insert of this session returned (the scheduler publishes
        a prompt chunk by chunk): a page of it still cached under its key, with these tokens,
        is taken as it is instead of hashing the prompt again from its start; the walk, and so
        what is cached and touched, is the same."""
        covered = self._insertable(pool, s, tokens, chain_id)
        rows, table = pool.page_rows, pool.table(s)
        chain: ChainRecord | None = self.chains.get(chain_id) if chain_id is not None else None
        parent: int | None = None
        path: list[CachedPage] = []
        new: list[CachedPage] = []
        room: int | None = -1  # -1: not yet known (computed at the first new page)
        left_out = 0
        n_full = covered // rows
        for i in range(n_full):
            if i < len(known):
                entry = known[i]
                if self.pages.get(entry.key) is entry and entry.parent == parent and (
                        self.id_keys or entry.tokens == tuple(tokens[i * rows:(i + 1) * rows])):
                    path.append(entry)
                    parent = entry.key
                    continue
            toks = tuple(map(int, tokens[i * rows:(i + 1) * rows]))
            key = self.page_key(parent, toks, namespace)
            entry = self.pages.get(key)
            if entry is not None:
                if not self.verify(entry, parent, toks, namespace):
                    break  # a hash collision: never store under another prefix's key
                path.append(entry)
                parent = key
                continue
            page = table[i]
            if page in self.by_page:
                break  # this pool page already caches another prefix (e.g. another namespace)
            if room == -1:
                room = self._room(path)
            if room is not None and len(new) >= room:
                left_out = n_full - i  # caching these would evict a pinned page: cache less instead
                break
            if chain is None:
                chain = ChainRecord(id=next(self._chain_ids), n_tokens=0, pages_live=0, hits=0,
                                    preview=preview, created_at=time.time(), namespace=namespace,
                                    first_page_depth=i)
                self.chains[chain.id] = chain
            pool.retain(page)
            # Positional: half the cost of keywords, once per new page (a replay makes ~10^5).
            entry = CachedPage(key, page, () if self.id_keys else toks, parent, namespace, i, chain.id)
            parent_free = path[-1].free if path else None
            entry.free = key if not namespace else self.free_key(parent_free, toks)
            self.seen.saw(entry.free, parent_free, entry.tokens, namespace, key, self.actor)
            self.pages[key] = entry
            self.by_page[page] = key
            self._link(entry)
            path.append(entry)
            new.append(entry)
            chain.n_tokens += rows
            chain.pages_live += 1
            parent = key
        # Touch root to leaf once the links exist: parents stay older than their children
        # and only the path's leaf enters the LRU heap (no stale entry per inner page).
        for entry in path:
            self._touch(entry)
        self.counters.inserted_pages += len(new)
        if new:
            self._emit("stored", new)
        if left_out:
            log.info("prefix cache: %d page(s) of %r not cached: the budget of %d pages is held by "
                     "%d pinned page(s)", left_out, preview[:40], self.max_pages, self.pinned_pages())
        self.enforce_budget()
        return Inserted(len(new), left_out, path)

    def _insertable(self, pool: BlockManager, s: Session, tokens, chain_id: int | None) -> int:
        """How many of `tokens` the session evaluated (all of them must match what it did)."""
        _check_session(pool, s)
        if chain_id is not None and chain_id not in self.chains:
            raise ValueError(f"chain {chain_id} does not exist in this prefix cache "
                             f"(its pages were evicted or released)")
        self.bind(pool)
        evaluated = pool.tokens(s)
        covered = min(len(tokens), len(evaluated))
        if list(tokens[:covered]) != evaluated[:covered]:
            first = next((i for i, (a, b) in enumerate(zip(tokens, evaluated, strict=False)) if a != b),
                         min(len(evaluated), covered))
            raise ValueError(
                f"tokens differ from what session {s.id} evaluated, first at position {first}")
        return covered

    def attach(self, pool: BlockManager, s: Session, prompt, namespace: str = "") -> int:
        """`prefix_attach` (engine/api.py): attach the cached pages matching the prompt's start,
        loading the next ones back from the disk tier when it holds them."""
        return len(self._attach(pool, s, prompt, namespace)[0]) * (self.page_rows or 0)

    def attach_accounted(self, pool: BlockManager, s: Session, prompt,
                         namespace: str = "") -> tuple[int, Account, Account]:
        """`attach`, and where every prompt token went, decided by the same walk (docs/design.md
        §15): (tokens attached, the operator's account, the tenant's own account)."""
        matched, n_disk = self._attach(pool, s, prompt, namespace)
        if self.pool is None:
            cold = Account(TokenParts(new=len(prompt)))
            return 0, cold, cold
        held = self._held_request(prompt, namespace, matched)
        return (len(matched) * self.page_rows,
                *self.account(prompt, namespace, len(matched), n_disk, 0,
                              matched[-1].free if matched else None, held))

    def _attach(self, pool: BlockManager, s: Session, prompt, namespace: str) -> tuple[list[CachedPage], int]:
        """Attach; return the matched pages (root to leaf) and how many came from the disk tier."""
        _check_session(pool, s)
        pool.check_fresh(s)
        self._check_pool(pool)
        self.counters.queries += 1
        if self.pool is None:
            return [], 0
        rows = pool.page_rows
        matched: list[CachedPage] = []
        cap = attach_cap(len(prompt), rows)
        for _, _, entry, ok in self.walk(prompt, namespace, cap):
            if not ok:
                break
            matched.append(entry)
        n_disk = 0
        if self.tier is not None and len(matched) < cap:
            loaded = self._promote(pool, prompt, namespace, matched, cap)
            matched += loaded
            n_disk = len(loaded)
        n = len(matched) * rows
        pool.attach(s, [e.page for e in matched], prompt[:n])
        for entry in matched:
            self._touch(entry)
        if matched:
            self.count_hit(matched[-1].chain_id, len(matched), n)
        return matched, n_disk

    def count_hit(self, chain_id: int | None, n_pages: int, n_tokens: int) -> None:
        """Count a hit of `n_pages` (`n_tokens`) ending in chain `chain_id`: an attach's, or a
        prompt's that shared pages another stream was computing (engine/lending.py)."""
        chain = self.chains.get(chain_id)
        if chain is not None:
            chain.hits += 1
            chain.last_hit_at = time.time()
        self.counters.hits += 1
        self.counters.hit_pages += n_pages
        self.counters.tokens_saved += n_tokens

    def count_query(self) -> None:
        """Count a lookup that did not go through `attach` (a prompt that shared lent pages)."""
        self.counters.queries += 1

    def probe(self, prompt, namespace: str = "") -> ProbeResult:
        """`prefix_probe` (engine/api.py): read-only, how far `prompt` would match and why it stops."""
        if len(prompt) == 0:
            return ProbeResult(0, 0, "end", None, None)
        if self.pool is None:
            return ProbeResult(0, 0, "miss", 0, None)  # nothing was ever cached
        rows = self.page_rows
        cap = attach_cap(len(prompt), rows)
        n_full = len(prompt) // rows
        matched, parent, last_chain = 0, None, None
        for i, key, entry, ok in self.walk(prompt, namespace, n_full):
            if ok and i < cap:
                matched, parent, last_chain = i + 1, key, entry.chain_id
                continue
            if ok:  # the cache holds this page but the cap keeps one token for the model
                return ProbeResult(matched * rows, matched, "cap", None, entry.chain_id)
            toks = [int(t) for t in prompt[i * rows:(i + 1) * rows]]
            lcp, near = self._nearest(parent, namespace, toks)
            reason = "token_mismatch" if entry is not None else "miss"
            return _departure(matched, rows, reason, i * rows + lcp, lcp, near, last_chain)
        # Out of full pages: the rest of the prompt is a partial page (never attached).
        tail = [int(t) for t in prompt[matched * rows:]]
        lcp, near = self._nearest(parent, namespace, tail)
        diff = None if lcp == len(tail) else matched * rows + lcp
        return _departure(matched, rows, "end", diff, lcp, near, last_chain)

    # where every token went (docs/design.md §15) --------------------------
    def _held_request(self, prompt, namespace: str,
                      matched: list[CachedPage]) -> tuple[int, int | None] | None:
        """When the cache (pool or disk tier) holds the whole prompt and only the attach cap kept
        the rest back: (the prompt's length, the request that cached its last page); else None."""
        rows, n = self.page_rows, len(prompt)
        if not n or len(matched) < attach_cap(n, rows):
            return None
        parent_free = matched[-1].free if matched else None
        rest = prompt[len(matched) * rows:]
        if len(rest) == rows:   # a whole page: its key says
            seen = self.seen.get(self.free_key(parent_free, rest), parent_free,
                                 () if self.id_keys else rest)
            sighting = seen.of(namespace) if seen is not None else None
        else:                   # the prompt ends inside a page an earlier prompt filled
            lcp, sighting = self.seen.nearest(parent_free, rest, namespace)
            sighting = sighting if lcp == len(rest) else None
        if sighting is None or not (sighting.key in self.pages
                                    or (self.tier is not None and self.tier.get(sighting.key))):
            return None
        return n, sighting.request

    def account(self, prompt, namespace: str, n_cached: int, n_disk: int = 0, n_lent: int = 0,
                last_free: int | None = None,
                held: tuple[int, int | None] | None = None) -> tuple[Account, Account]:
        """Where the prompt's tokens went, given the pages attached (`n_cached`, `n_disk` of them
        loaded from the disk tier) and lent (`n_lent`) after them: (the operator's account, the
        tenant's, which looks only at `namespace`). `last_free` is the free key of the last of
        those pages (None: hashed here); `held` = (tokens held, request) when something holds the
        prompt this far and only the attach cap kept it back (`_held_request`, or a lender's)."""
        rows, n = self.page_rows, len(prompt)
        pos = min((n_cached + n_lent) * rows, n)
        base = {"cached": n_cached * rows, "disk": n_disk * rows, "lent": n_lent * rows}
        if held is not None and held[0] >= n:
            acc = Account(TokenParts(**base, cap=n - pos), n, held[1])
            return acc, acc
        start = pos // rows
        if last_free is None and start:
            for i in range(start):
                last_free = self.free_key(last_free, prompt[i * rows:(i + 1) * rows])
        # Walk the ever-seen index past the attached pages: this namespace's pages first, then
        # pages only other namespaces had (chained keys: a namespace that had a page had its parent).
        frees, own_n, first = [last_free], 0, None
        for i in range(start, n // rows):
            toks = prompt[i * rows:(i + 1) * rows]
            free = self.free_key(frees[-1], toks)
            seen = self.seen.get(free, frees[-1], () if self.id_keys else toks)
            if seen is None:
                break
            mine = seen.of(namespace)
            if mine is not None and own_n == len(frees) - 1:
                own_n += 1
                first = first or mine
            frees.append(free)
        evicted_by = first.evicted if first is not None else None

        def view(n_pages: int, ns: str | None) -> Account:
            at = start + n_pages
            piece = () if self.id_keys else prompt[at * rows:(at + 1) * rows]
            lcp, sighting = self.seen.nearest(frees[n_pages], piece, ns)
            by = sighting.request if sighting is not None else None
            if held is not None and n_pages == 0 and held[0] - pos >= lcp:  # a lender's prompt
                lcp, by = held[0] - pos, held[1]
            elif not lcp:
                by = self._request_of(frees[n_pages], namespace, ns is None) if at else None
            diverged = at * rows + lcp
            parts = TokenParts(**base, evicted=own_n * rows, isolated=(n_pages - own_n) * rows,
                               rounding=lcp, new=n - diverged)
            return Account(parts, diverged or None, by, evicted_by)
        operator = view(len(frees) - 1, None)
        return operator, operator if self.seen.only(namespace) else view(own_n, namespace)

    def _request_of(self, free: int | None, namespace: str, any_ns: bool) -> int | None:
        """The request that first cached a page (by free key) in `namespace`, else (`any_ns`)
        in any namespace."""
        seen = self.seen.pages.get(free) if free is not None else None
        if seen is None:
            return None
        sighting = seen.of(namespace) or (seen if any_ns else None)
        return sighting.request if sighting is not None else None

    def chain_list(self) -> list[ChainRecord]:
        """Snapshots (copies) of every chain that still has a live page, oldest first."""
        return [copy.copy(c) for c in self.chains.values() if c.pages_live > 0]

    def held_groups(self) -> int:
        """How many pool pages the cache holds a reference on."""
        return len(self.by_page)

    def held_pages(self) -> list[int]:
        """The pool pages the cache holds a reference on, ascending."""
        return sorted(self.by_page)

    def release(self, pool: BlockManager) -> int:
        """Hand every cached page back to the pool; return how many."""
        self._check_pool(pool)
        n = len(self.pages)
        gone = Eviction("flush", self.actor, self.max_pages)
        for entry in self.pages.values():
            self.seen.evicted(entry.free, entry.namespace, gone)
            pool.release(entry.page)
        self.pages.clear()
        self.by_page.clear()
        self.roots.clear()
        self.siblings.clear()
        self.chains.clear()
        self.policy.clear()
        if self.tier is not None:
            self.tier.clear()
        self._emit("cleared")
        return n

    # pins -------------------------------------------------------------
    def pin(self, chain_id: int, pinned: bool = True) -> None:
        """Keep (or, with pinned=False, stop keeping) a chain's pages from eviction."""
        chain = self.chains.get(chain_id)
        if chain is None:
            raise ValueError(f"chain {chain_id} does not exist in this prefix cache "
                             f"(its pages were evicted or released)")
        chain.pinned = pinned
        self._pin_changes += 1
        if not pinned:
            self.enforce_budget()  # an unpinned chain over the budget goes now

    def pinned_pages(self) -> int:
        """Cached pages of pinned chains: they count against the budget and are never evicted."""
        return sum(c.pages_live for c in self.chains.values() if c.pinned)

    def _room(self, path: list[CachedPage]) -> int | None:
        """New pages the budget can keep behind `path` without evicting a pinned page (None: any)."""
        if not self.max_pages:
            return None
        pinned = self.pinned_pages()
        if not pinned:
            return None
        kept = pinned + sum(1 for e in path if not self.chains[e.chain_id].pinned)
        return max(0, self.max_pages - kept)

    # eviction ---------------------------------------------------------
    def _touch(self, entry: CachedPage) -> None:
        entry.last_used = next(self._clock)
        entry.uses += 1
        self.policy.touched(entry, self.pages)

    def _unheld(self, entry: CachedPage) -> bool:
        # only the cache's own reference, and no pin on its chain
        return self.pool.refcount_of(entry.page) == 1 and not self.chains[entry.chain_id].pinned

    def evict(self, n: int, cause: str = "flush") -> int:
        """Give back up to n pages no session holds, in the policy's order; return how many.
        `cause` ("budget", "pool", "flush") is what the ever-seen index records for them."""
        removed: list[CachedPage] = []
        budget = self.max_pages if cause == "budget" else (self.pool.max_pages or 0) if cause == "pool" else 0
        eviction = Eviction(cause, self.actor, budget)

        def remove(entry: CachedPage) -> None:
            if self.tier is not None:
                self._demote(entry)  # its K/V go down to the disk tier before the page is freed
            self._remove(entry)
            self.seen.evicted(entry.free, entry.namespace, eviction)
            removed.append(entry)
        self.policy.evict(n, self.pages, self._unheld, remove)
        if removed:
            self._emit("removed", removed)
        return len(removed)

    def give_back(self, n: int) -> int:
        """The pool's evictor (BlockManager.bind_evictor): `n` pages for an allocation that found
        none free, or with n=0, after a session's release, what is over the budget. How many went."""
        return self.evict(n, "pool") if n else self.enforce_budget()

    def num_evictable(self) -> int:
        """Cached pages eviction can give back, now or once their children went: pages that
        no session holds and no pin keeps, with no such page below them. A held page blocks
        itself and its ancestors, so the walk starts from the sessions' pages (and pinned
        chains' pages, when a chain is pinned), not from every cached page: an admission
        under a full pool asks this, and a twin's pool holds thousands of cached pages."""
        by_page, pages = self.by_page, self.pages
        memo = (self.pool.version, len(pages), self._pin_changes)
        if self._evictable[0] == memo:  # a request waiting for pages asks every pass
            return self._evictable[1]
        held = [by_page[p] for p in self.pool.session_pages() if p in by_page]
        if any(c.pinned for c in self.chains.values()):
            held += [e.key for e in pages.values() if self.chains[e.chain_id].pinned]
        blocked: set[int] = set()
        for key in held:
            while key not in blocked:
                blocked.add(key)
                entry = pages.get(key)  # a parent another policy evicted first still blocks its key
                if entry is None or entry.parent is None:
                    break
                key = entry.parent
        self._evictable = (memo, len(pages) - len(blocked))
        return self._evictable[1]

    def enforce_budget(self) -> int:
        """Evict down to the budget as far as pages can be given back (after inserts and releases);
        return how many went."""
        if self.max_pages and len(self.pages) > self.max_pages:
            return self.evict(len(self.pages) - self.max_pages, "budget")
        return 0

    # the tree ---------------------------------------------------------
    def _link(self, entry: CachedPage) -> None:
        """Add a new page to the tree: its parent's children (or the roots) and the sibling index."""
        entry.born = next(self._births)
        if entry.parent is None:
            self.roots.setdefault(entry.namespace, set()).add(entry.key)
        else:
            self.pages[entry.parent].children.add(entry.key)
        self.policy.added(entry)
        self._index(entry)

    def _place(self, pool: BlockManager, page: int, key: int, parent, toks, namespace: str, depth: int,
               chain: ChainRecord) -> CachedPage:
        """A cached page on pool page `page` (its K/V written already), linked and touched."""
        if chain.id not in self.chains:
            self.chains[chain.id] = chain
        entry = CachedPage(key, page, toks, parent, namespace, depth, chain.id)
        parent_free = self.pages[parent].free if parent is not None else None
        entry.free = key if not namespace else self.free_key(parent_free, toks)
        self.seen.saw(entry.free, parent_free, toks, namespace, key, self.actor)
        self.pages[key] = entry
        self.by_page[page] = key
        self._link(entry)
        self._touch(entry)
        chain.pages_live += 1
        chain.n_tokens += pool.page_rows
        return entry

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

    # the sibling index: one trie of tokens per parent, so a probe names the nearest cached page
    def _index(self, entry: CachedPage) -> None:
        """Index a new page's tokens under its parent (id-keyed caches store none)."""
        if self.id_keys:
            return
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

    def _nearest(self, parent: int | None, namespace: str, toks) -> tuple[int, CachedPage | None]:
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

    # the disk tier's moves --------------------------------------------
    def _demote(self, entry: CachedPage) -> None:
        """Send a page about to be evicted down to the disk tier (the eviction then frees it)."""
        dropped = self.tier.demote(entry, self.pool, self.chains[entry.chain_id].preview)
        if self.tier.get(entry.key) is not None:  # else a full or failing disk (the tier said so)
            self.counters.demoted_pages += 1
            self._emit("stored", [entry], medium="CPU")
        if dropped:
            self._emit("removed", dropped, medium="CPU")

    def _path(self, prompt, namespace: str, start: int, stop: int,
              parent: int | None) -> Iterator[tuple[int, int | None, tuple]]:
        """(key, parent key, tokens a page must hold) of the prompt's pages start..stop-1, lazily."""
        rows = self.page_rows
        for i in range(start, stop):
            toks = prompt[i * rows:(i + 1) * rows]
            key = self.page_key(parent, toks, namespace)
            yield key, parent, () if self.id_keys else tuple(toks)
            parent = key

    def _promote(self, pool: BlockManager, prompt, namespace: str, matched: list[CachedPage],
                 cap: int) -> list[CachedPage]:
        """Cache again the pages after `matched` that the disk tier gives back (up to `cap` pages
        in all); return them, root to leaf."""
        start = len(matched)
        path = self._path(prompt, namespace, start, cap, matched[-1].key if matched else None)
        loaded = []
        moved, lost = self.tier.promote(pool, path, namespace)
        if lost is not None:
            self._emit("removed", [lost], medium="CPU")
        for depth, (tp, page) in enumerate(moved, start):
            chain = self.chains.get(tp.chain_id) or ChainRecord(
                id=tp.chain_id, n_tokens=0, pages_live=0, hits=0, preview=tp.preview,
                created_at=time.time(), namespace=namespace, first_page_depth=depth)
            loaded.append(self._place(pool, page, tp.key, tp.parent, tp.tokens, namespace, depth, chain))
        if loaded:
            self.counters.disk_hit_pages += len(loaded)
            self.counters.disk_hits += 1
            self._emit("removed", loaded, medium="CPU")
            self._emit("stored", loaded)
        return loaded

    # saved pages ------------------------------------------------------
    def adopt(self, pool: BlockManager, pages: list[tuple], chains: list[ChainRecord],
              fill: Callable[[int, int], None]) -> int:
        """Re-create saved pages (parents first), each on a fresh pool page that `fill(i, page)`
        writes; `pages[i]` is (key, parent, tokens, namespace, depth, chain id). A page whose key
        is not its tokens' key is refused (ValueError); what is cached already, or has no parent,
        is skipped; it stops at the budget or a full pool. Returns the pages re-created."""
        self.bind(pool)
        ids = {c.id: next(self._chain_ids) for c in chains}
        records = {c.id: dataclasses.replace(c, id=ids[c.id], pages_live=0, n_tokens=0) for c in chains}
        new: list[CachedPage] = []
        for i, (key, parent, toks, namespace, depth, chain_id) in enumerate(pages):
            toks = tuple(int(t) for t in toks)
            if self.page_key(parent, toks, namespace) != key:
                raise ValueError(f"saved page {i} does not hash to its key")
            if key in self.pages or (parent is not None and parent not in self.pages):
                continue
            if (self.max_pages and len(self.pages) >= self.max_pages) or (
                    pool.max_pages is not None and not pool.num_free_pages):
                break
            page = pool.alloc()
            fill(i, page)
            entry = self._place(pool, page, key, parent, toks, namespace, depth, records[chain_id])
            new.append(entry)
        if new:
            self._emit("stored", new)
        return len(new)


def _departure(matched: int, rows: int, reason: str, diff: int | None, lcp: int,
               near: CachedPage | None, last_chain: int | None) -> ProbeResult:
    """A probe that leaves the cached path: where, and what the nearest cached page holds there."""
    cached = near.tokens[lcp] if near is not None and diff is not None and lcp < len(near.tokens) else None
    return ProbeResult(matched * rows, matched, reason, diff, near.chain_id if near else last_chain, cached)
