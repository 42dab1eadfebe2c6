"""Eviction policies of the prefix cache: which cached page is given back first (docs/design.md §3).

A policy keeps a lazy min-heap of (priority, key) over the pages it may evict.
The cache tells it when a page is touched (a hit or an insert), added, or left
without cached children; an entry in the heap is stale, and skipped, once the
page is gone or its priority has changed. Priorities are single integers so
the heap compares plain ints (the replay of a 12k-request trace pushes ~10^6).

- leaf-lru: least recently used page with no cached child (the engine's default:
  the deepest page of a chain goes first, nothing is stranded).
- lru: least recently used page of any depth (dasLLAMA's plain LRU); its cached
  descendants stay, count against the budget and cannot be hit until the page
  is inserted again.
- lfu: fewest hits + inserts, ties broken by least recent use; leaves only.
- fifo: first inserted first; leaves only; recency is ignored.
"""

from __future__ import annotations

import heapq

# LFU packs (uses, last_used) into one int: recency stamps stay below 2**40.
_LFU_SHIFT = 40


class EvictionPolicy:
    """Base: a lazy heap of candidates; subclasses say which pages and in what order."""

    name = ""
    leaves_only = True

    def __init__(self):
        self.heap: list[tuple[int, int]] = []

    def priority(self, entry) -> int:
        raise NotImplementedError

    def candidate(self, entry) -> bool:
        return not (self.leaves_only and entry.children)

    def push(self, entry) -> None:
        heapq.heappush(self.heap, (self.priority(entry), entry.key))

    def touched(self, entry, pages: dict) -> None:
        """A hit or insert refreshed `entry` (its stamps are already updated)."""
        if self.candidate(entry):
            self.push(entry)
            if len(self.heap) > 2 * len(pages) + 64:
                self.compact(pages)

    def added(self, entry) -> None:
        """A new page joined the cache (the cache touches it right after)."""

    def became_leaf(self, entry) -> None:
        """`entry` lost its last cached child."""
        if self.leaves_only:
            self.push(entry)

    def current(self, prio: int, key: int, pages: dict) -> bool:
        entry = pages.get(key)
        return entry is not None and self.candidate(entry) and self.priority(entry) == prio

    def compact(self, pages: dict) -> None:
        # Every re-touch leaves a stale entry; dropping them is O(heap) once per O(cache) pushes.
        self.heap = [item for item in set(self.heap) if self.current(*item, pages)]
        heapq.heapify(self.heap)

    def evict(self, n: int, pages: dict, can_evict, remove) -> int:
        """Remove up to n candidates, first to go first, that `can_evict` allows; return how many."""
        heap, held, done = self.heap, [], 0
        while done < n and heap:
            prio, key = heapq.heappop(heap)
            if not self.current(prio, key, pages):
                continue  # stale
            entry = pages[key]
            if not can_evict(entry):
                held.append((prio, key))
                continue
            remove(entry)  # may make its parent a leaf, a candidate in this same batch
            done += 1
        for item in held:
            heapq.heappush(heap, item)
        return done

    def clear(self) -> None:
        self.heap.clear()


class LeafLRU(EvictionPolicy):
    """Least recently used leaf first (the engine's default)."""

    name = "leaf-lru"

    def priority(self, entry) -> int:
        return entry.last_used

    def touched(self, entry, pages: dict) -> None:
        # The base's logic, inlined: this runs once per page of every hit and insert.
        if not entry.children:
            heap = self.heap
            heapq.heappush(heap, (entry.last_used, entry.key))
            if len(heap) > 2 * len(pages) + 64:
                self.compact(pages)


class PlainLRU(EvictionPolicy):
    """Least recently used page of any depth first; descendants stay stranded."""

    name = "lru"
    leaves_only = False

    def priority(self, entry) -> int:
        return entry.last_used


class LFU(EvictionPolicy):
    """Fewest hits + inserts first, then least recently used; leaves only."""

    name = "lfu"

    def priority(self, entry) -> int:
        return (entry.uses << _LFU_SHIFT) | entry.last_used


class FIFO(EvictionPolicy):
    """First inserted first, whatever its use since; leaves only."""

    name = "fifo"

    def priority(self, entry) -> int:
        return entry.born

    def touched(self, entry, pages: dict) -> None:
        """Use does not move a page in FIFO order: it entered the heap when it was added."""

    def added(self, entry) -> None:
        self.push(entry)


POLICIES = {p.name: p for p in (LeafLRU, PlainLRU, LFU, FIFO)}
DEFAULT_POLICY = LeafLRU.name


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by name: leaf-lru, lru, lfu or fifo."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; one of {', '.join(POLICIES)}") from None
