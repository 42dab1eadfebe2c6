"""The prefix cache's read side: the tokens of sibling pages (one trie per parent) and the
read-only probe that says how far a prompt would match and why it stops."""

from __future__ import annotations

from .block_manager import attach_cap
from .prefix_records import CachedPage, ProbeResult


class _Trie:
    """The tokens of sibling pages (one parent), so a probe finds the nearest in O(page_rows)."""

    __slots__ = ("n", "next", "key")

    def __init__(self):
        self.n = 0                        # sibling pages whose tokens pass through this node
        self.next: dict[int, _Trie] = {}
        self.key: int | None = None       # the page whose tokens end here


class ProbeIndex:
    """Mixin of PrefixCache: the sibling tries (`siblings`), `walk`, `nearest` and `probe`."""

    siblings: dict[tuple[str, int | None], _Trie]

    def index(self, entry: CachedPage) -> None:
        """Index a new page's tokens under its parent (id-keyed caches store none)."""
        if self.id_keys:
            return
        node = self.siblings.setdefault((entry.namespace, entry.parent), _Trie())
        node.n += 1
        for t in entry.tokens:
            node = node.next.setdefault(t, _Trie())
            node.n += 1
        node.key = entry.key

    def unindex(self, entry: CachedPage) -> None:
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

    def probe(self, prompt, namespace: str = "") -> ProbeResult:
        """Read-only: how far `prompt` would match and why it stops (see `prefix_probe`)."""
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
            lcp, near = self.nearest(parent, namespace, toks)
            reason = "token_mismatch" if entry is not None else "miss"
            return _departure(matched, rows, reason, i * rows + lcp, lcp, near, last_chain)
        # Out of full pages: the rest of the prompt is a partial page (never attached).
        tail = [int(t) for t in prompt[matched * rows:]]
        lcp, near = self.nearest(parent, namespace, tail)
        diff = None if lcp == len(tail) else matched * rows + lcp
        return _departure(matched, rows, "end", diff, lcp, near, last_chain)


def _departure(matched: int, rows: int, reason: str, diff: int | None, lcp: int,
               near: CachedPage | None, last_chain: int | None) -> ProbeResult:
    """A probe that leaves the cached path: where, and what the nearest cached page holds there."""
    cached = near.tokens[lcp] if near is not None and diff is not None and lcp < len(near.tokens) else None
    return ProbeResult(matched * rows, matched, reason, diff, near.chain_id if near else last_chain, cached)
