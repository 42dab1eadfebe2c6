"""Where every prompt token went (docs/design.md §15): a request's prompt split into parts that
add up to the prompt, and the bounded "ever seen" index of pages behind `evicted`, `isolated`
and `new`.

The parts are decided by the prefix cache's own attach (engine/prefix_cache.py,
`PrefixCache.account`), never re-derived afterwards. In prompt order they are:
`cached` (attached pages; `disk` counts those of them loaded back from the disk tier, so it is
part of `cached`, not beside it), `lent` (pages another stream is computing in the same pass),
`cap` (held by the cache but kept back so the model evaluates one token), `evicted` (pages this
namespace inserted once that are no longer cached), `isolated` (pages only another namespace
had), `rounding` (tokens shared with an earlier prompt inside a page that is not whole), and
`new` (no earlier prompt within the index's reach had them).
"""

from __future__ import annotations

import bisect
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, fields

# The parts that add up to the prompt, in prompt order (`disk` is a share of `cached`).
PARTS = ("cached", "lent", "cap", "evicted", "isolated", "rounding", "new")
# Every count a request carries: the parts, with `disk` after `cached`.
KEYS = ("cached", "disk", "lent", "rounding", "cap", "evicted", "isolated", "new")
# Pages the ever-seen index remembers (chained keys, least recently seen go first): at 16
# rows a page, half a million prompt tokens. Past its reach a page counts as `new`.
SEEN_PAGES = 32_768


@dataclass(frozen=True)
class TokenParts:
    """One request's prompt tokens by part: `total` (the parts in PARTS) is its prompt length."""

    cached: int = 0
    disk: int = 0        # of `cached`, the tokens loaded back from the disk tier
    lent: int = 0
    rounding: int = 0
    cap: int = 0
    evicted: int = 0
    isolated: int = 0
    new: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, p) for p in PARTS)

    def as_dict(self) -> dict[str, int]:
        """{part: tokens} in KEYS order (the JSON every front end writes)."""
        return {k: getattr(self, k) for k in KEYS}

    def private(self) -> TokenParts:
        """What the request's own tenant is told: another namespace's pages count as `new`
        (a match across namespaces is the side channel `cache_salt` closes)."""
        return TokenParts(**{**asdict(self), "isolated": 0, "new": self.new + self.isolated})

    def scaled(self, block: int, n_tokens: int) -> TokenParts:
        """Parts counted in blocks (a hash-id trace's pages) as tokens of a prompt of `n_tokens`:
        each part's edge in prompt order at `block` tokens a block, the last block partial."""
        edge, out = 0, {}
        for p in PARTS:
            end = edge + getattr(self, p)
            out[p] = min(end * block, n_tokens) - min(edge * block, n_tokens)
            edge = end
        out["new"] += n_tokens - min(edge * block, n_tokens)   # tokens past the blocks listed
        return TokenParts(**out, disk=min(self.disk * block, out["cached"]))

    @classmethod
    def from_dict(cls, d: dict) -> TokenParts:
        """The inverse of `as_dict` (a report's row); missing keys count 0."""
        return cls(**{f.name: int(d.get(f.name, 0)) for f in fields(cls)})


def add_parts(totals: dict[str, int], parts: TokenParts) -> None:
    """Add one request's parts into running totals keyed by KEYS."""
    for k in KEYS:
        totals[k] = totals.get(k, 0) + getattr(parts, k)


def zero_totals() -> dict[str, int]:
    return dict.fromkeys(KEYS, 0)


def describe_totals(totals: dict[str, int]) -> str:
    """Totals by part in one line: "prompt tokens 402: cached 96 (disk 0), lent 0, ... new 300"."""
    n = sum(totals.get(p, 0) for p in PARTS)
    words = [f"{k} {totals.get(k, 0):,}" for k in PARTS if k != "cached"]
    return (f"prompt tokens {n:,}: cached {totals.get('cached', 0):,} (disk {totals.get('disk', 0):,}), "
            + ", ".join(words))


@dataclass(frozen=True)
class Eviction:
    """When a page left the cache and why: `cause` "budget" (the cache's page budget), "pool"
    (a bounded pool needed the page) or "flush" (asked for); `request`, the request whose
    insert, admission or release it happened in (None: none was running)."""

    cause: str
    request: int | None
    budget_pages: int
    at: float = field(default_factory=time.time)   # seconds since the epoch

    def describe(self) -> str:
        what = {"budget": f"the cache budget of {self.budget_pages} pages",
                "pool": f"a full pool of {self.budget_pages} pages",
                "flush": "a flush of the cache"}[self.cause]
        by = f", during request {self.request}" if self.request is not None else ""
        return f"evicted by {what}{by}, at {time.strftime('%H:%M:%S', time.gmtime(self.at))} UTC"


@dataclass(frozen=True)
class Account:
    """A request's parts and where it departed from the longest earlier prompt sharing its
    start: `diverged_at` (a token index; the prompt length when it never departs; None when
    no earlier prompt shares its first token) and `diverged_from` (that request's id).
    `evicted_by` says when and why its first evicted page went."""

    parts: TokenParts
    diverged_at: int | None = None
    diverged_from: int | None = None
    evicted_by: Eviction | None = None


class Sighting:
    """A page as one namespace had it: its key there, the request that first inserted it and,
    once it left the pool, its eviction (it may sit in the disk tier since)."""

    __slots__ = ("key", "request", "evicted")

    def __init__(self, key: int, request: int | None):
        self.key = key
        self.request = request
        self.evicted: Eviction | None = None


class Seen(Sighting):
    """One page of content as every namespace saw it, keyed by its namespace-free chained key:
    it is the sighting of the first namespace that cached it (most pages have only one, and a
    replay keeps a quarter of a million), with any others' in `others`."""

    __slots__ = ("parent", "tokens", "namespace", "others")

    def __init__(self, parent: int | None, tokens: tuple, namespace: str, key: int, request: int | None):
        super().__init__(key, request)
        self.parent = parent
        self.tokens = tokens
        self.namespace = namespace
        self.others: dict[str, Sighting] | None = None

    def of(self, namespace: str | None) -> Sighting | None:
        """`namespace`'s sighting of this page (None: it never cached it); with None, any's."""
        if namespace is None or namespace == self.namespace:
            return self
        return self.others.get(namespace) if self.others else None

    def add(self, namespace: str, key: int, request: int | None) -> None:
        if self.others is None:
            self.others = {}
        self.others[namespace] = Sighting(key, request)

    def names(self) -> list[str]:
        """Every namespace that cached this page."""
        return [self.namespace, *(self.others or ())]


class SeenIndex:
    """Every page ever cached, up to `max_pages` of them (least recently cached or evicted go first), by
    its namespace-free chained key (the key the page would have in the default namespace), with
    each namespace's sighting; plus each parent's children sorted by their tokens, so the token
    where a prompt departs inside a page is found in O(log siblings): the longest common prefix
    of a query with a sorted set is its neighbour's, before or after it. Once a second namespace
    caches a page, each namespace's children are also sorted on their own (`own`), so where a
    tenant's prompt departs is found among its own pages, whatever others sent."""

    def __init__(self, max_pages: int = SEEN_PAGES):
        if not isinstance(max_pages, int) or max_pages < 1:
            raise ValueError(f"the ever-seen index needs at least 1 page, got {max_pages!r}")
        self.max_pages = max_pages
        self.pages: OrderedDict[int, Seen] = OrderedDict()
        self.children: dict[int | None, list[tuple[tuple, int]]] = {}  # parent -> sorted (tokens, key)
        self.own: dict[tuple[int | None, str], list[tuple[tuple, int]]] | None = None  # (parent, ns) -> same
        self.namespaces: set[str] = set()   # every namespace that cached a page

    def __len__(self) -> int:
        return len(self.pages)

    def get(self, free: int, parent: int | None, tokens) -> Seen | None:
        """The page, when its key is known and its parent and tokens agree (tokens verify)."""
        seen = self.pages.get(free)
        if seen is None or seen.parent != parent or (seen.tokens and seen.tokens != tuple(tokens)):
            return None
        return seen

    def saw(self, free: int, parent: int | None, tokens: tuple, namespace: str, key: int,
            request: int | None) -> None:
        """A page is cached (inserted, loaded back or adopted) in `namespace` under `key`."""
        if self.own is None and self.namespaces and namespace not in self.namespaces:
            (first,) = self.namespaces   # a second namespace: each one's children sorted apart from now
            self.own = {(p, first): list(kids) for p, kids in self.children.items()}
        seen = self.pages.get(free)
        if seen is None:
            self.pages[free] = seen = Seen(parent, tokens, namespace, key, request)
            self.namespaces.add(namespace)
            if tokens:
                bisect.insort(self.children.setdefault(parent, []), (tokens, free))
            self._link(seen, free, namespace)
            if len(self.pages) > self.max_pages:
                self._drop()
            return
        self.pages.move_to_end(free)
        sighting = seen.of(namespace)
        if sighting is None:
            seen.add(namespace, key, request)
            self.namespaces.add(namespace)
            self._link(seen, free, namespace)
        else:
            sighting.evicted = None

    def _link(self, seen: Seen, free: int, namespace: str) -> None:
        """`namespace` cached the page: it joins that namespace's sorted children (once there are two)."""
        if self.own is not None and seen.tokens:
            bisect.insort(self.own.setdefault((seen.parent, namespace), []), (seen.tokens, free))

    def evicted(self, free: int, namespace: str, eviction: Eviction) -> None:
        """A page left the pool: it stays within reach longest from now (a page is "seen" when
        first cached and when evicted, not at each hit: a hit finds it in the cache itself)."""
        seen = self.pages.get(free)
        sighting = seen.of(namespace) if seen is not None else None
        if sighting is not None:
            sighting.evicted = eviction
            self.pages.move_to_end(free)

    def _drop(self) -> None:
        free, seen = self.pages.popitem(last=False)
        if seen.tokens:
            _unlink(self.children, seen.parent, (seen.tokens, free))
            for ns in seen.names() if self.own is not None else ():
                _unlink(self.own, (seen.parent, ns), (seen.tokens, free))

    def clear(self) -> None:
        self.pages.clear()
        self.children.clear()
        self.own = None
        self.namespaces.clear()

    def only(self, namespace: str) -> bool:
        """True when no namespace but `namespace` ever cached a page here (the operator's view of
        its requests is then the tenant's)."""
        return self.namespaces <= {namespace}

    def nearest(self, parent: int | None, piece, namespace: str | None) -> tuple[int, Sighting | None]:
        """Longest common prefix of `piece` with a seen page under `parent` (in `namespace`, or
        in any with None), and that page's sighting: the nearest sibling on each side of `piece`
        in sorted order among that namespace's pages (every namespace's with None)."""
        if namespace is None or (self.own is None and namespace in self.namespaces):
            kids = self.children.get(parent)   # every page, or the one namespace's
        else:
            kids = self.own.get((parent, namespace)) if self.own is not None else None
        if not kids or not len(piece):
            return 0, None
        query = tuple(int(t) for t in piece)
        at = bisect.bisect_left(kids, (query,))
        best, found = 0, None
        for tokens, free in kids[max(at - 1, 0):at + 1]:
            n = _common(tokens, query)
            if n > best:
                best, found = n, self.pages[free].of(namespace)
        return best, found


def _unlink(lists: dict, key, item: tuple) -> None:
    """Take `item` out of the sorted list `lists[key]`, and the list once empty."""
    kids = lists[key]
    del kids[bisect.bisect_left(kids, item)]
    if not kids:
        del lists[key]


def _common(a: tuple, b: tuple) -> int:
    """How many leading items two tuples share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
