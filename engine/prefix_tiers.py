"""The prefix cache's pages outside the pool: saved pages adopted back (persistence) and the
disk tier's moves (a page about to be evicted goes down; an attach brings it back up)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from .block_manager import BlockManager
from .prefix_records import CachedPage, ChainRecord


class TierMixin:
    """Mixin of PrefixCache: `adopt` (restore saved pages), `demote` and `promote` (disk tier)."""

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

    def _place(self, pool: BlockManager, page: int, key: int, parent, toks, namespace: str, depth: int,
               chain: ChainRecord) -> CachedPage:
        """A cached page on pool page `page` (its K/V written already), linked and touched."""
        if chain.id not in self.chains:
            self.chains[chain.id] = chain
        entry = CachedPage(key, page, toks, parent, namespace, depth, chain.id)
        self.pages[key] = entry
        self.by_page[page] = key
        self.link(entry)
        self.touch(entry)
        chain.pages_live += 1
        chain.n_tokens += pool.page_rows
        return entry

    # disk tier --------------------------------------------------------
    def demote(self, entry: CachedPage) -> None:
        """Copy a page about to be evicted into the disk tier (the eviction then frees it)."""
        chain = self.chains[entry.chain_id]
        dropped = self.tier.put(entry, self.pool, chain.preview)
        if self.tier.get(entry.key) is not None:  # else a full or failing disk (the tier said so)
            self.counters.demoted_pages += 1
            self._emit("stored", [entry], medium="CPU")
        if dropped:
            self._emit("removed", dropped, medium="CPU")

    def promote(self, pool: BlockManager, prompt, namespace: str, matched: list[CachedPage],
                cap: int) -> list[CachedPage]:
        """Load the pages after `matched` that the disk tier holds back into free pool pages
        (never evicting for them), up to `cap` pages in all; return them, root to leaf."""
        rows, tier = pool.page_rows, self.tier
        parent = matched[-1].key if matched else None
        loaded: list[CachedPage] = []
        t0 = time.perf_counter()
        for i in range(len(matched), cap):
            toks = prompt[i * rows:(i + 1) * rows]
            key = self.page_key(parent, toks, namespace)
            tp = tier.get(key)
            if tp is None or not self.verify(tp, parent, toks, namespace):
                break
            if pool.max_pages is not None and not pool.num_free_pages:
                break  # loading must not evict what this attach is about to use
            page = pool.alloc()
            if tier.take(key, pool, page) is None:  # unreadable or damaged: gone, a miss from here
                pool.release(page)
                self._emit("removed", [tp], medium="CPU")
                break
            chain = self.chains.get(tp.chain_id) or ChainRecord(
                id=tp.chain_id, n_tokens=0, pages_live=0, hits=0, preview=tp.preview,
                created_at=time.time(), namespace=namespace, first_page_depth=i)
            loaded.append(self._place(pool, page, key, parent, tp.tokens, namespace, i, chain))
            parent = key
        if loaded:
            tier.load_seconds += time.perf_counter() - t0
            self.counters.disk_hit_pages += len(loaded)
            self.counters.disk_hits += 1
            self._emit("removed", loaded, medium="CPU")
            self._emit("stored", loaded)
        return loaded
