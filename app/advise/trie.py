"""Earlier prompts of one scope in a radix trie of tokens whose nodes keep the latest last-use of
any prompt through them (and which prompt that was), so the longest common prefix with a prompt
still alive (last use at most ttl seconds ago) is one walk."""

from __future__ import annotations

import heapq


class _Node:
    """A run of tokens shared by the prompts below it (a radix trie: one node per branch, not per token)."""

    __slots__ = ("children", "edge", "last", "owner")

    def __init__(self, edge: list[int], last: float, owner: int):
        self.edge = edge
        self.children: dict[int, _Node] = {}
        self.last, self.owner = last, owner


def _shared(edge: list[int], tokens: list[int], at: int) -> int:
    """How many tokens of `edge` equal tokens[at:] from their start."""
    m = min(len(edge), len(tokens) - at)
    if edge[:m] == tokens[at:at + m]:
        return m
    k = 0
    while edge[k] == tokens[at + k]:
        k += 1
    return k


class PromptTrie:
    """Earlier prompts of one routing key, with their last uses."""

    def __init__(self):
        self.root = _Node([], float("inf"), -1)
        self.prompts: dict[int, list[int]] = {}
        self.pending: list[tuple] = []  # a heap of (readable after, id, tokens, used at)

    def add_when_ready(self, pid: int, tokens: list[int], used: float, ready: float) -> None:
        """Prompt `pid` (used at `used`) joins once its answer has begun: for requests arriving
        after `ready` (docs/design.md §14: an entry is not readable while it is being prefilled)."""
        heapq.heappush(self.pending, (ready, pid, tokens, used))

    def ready(self, now: float) -> None:
        """The pending prompts readable by a request arriving at `now` join."""
        while self.pending and self.pending[0][0] < now:
            _, pid, tokens, used = heapq.heappop(self.pending)
            self.add(pid, tokens, used)

    def match(self, tokens: list[int], now: float, ttl: float) -> tuple[int, int]:
        """(L, the prompt matched): the longest common prefix with a prompt used at most `ttl`
        seconds before `now`; the prompt is the most recently used one sharing those L tokens."""
        node, depth = self.root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None or now - child.last > ttl:
                break
            k = _shared(child.edge, tokens, depth)
            node, depth = child, depth + k
            if k < len(child.edge):
                break
        return depth, node.owner

    def touch(self, pid: int, now: float) -> None:
        """Prompt `pid` was used at `now` (a hit refreshes the whole prompt it matched)."""
        self._walk(self.prompts[pid], pid, now)

    def add(self, pid: int, tokens: list[int], now: float) -> None:
        """Prompt `pid` joins the cache, last used at `now`."""
        self.prompts[pid] = tokens
        self._walk(tokens, pid, now)

    def _walk(self, tokens: list[int], pid: int, now: float) -> None:
        """Mark every node on `tokens`' path used by `pid` at `now` (unless used later already),
        splitting edges where it ends or leaves them."""
        node, depth = self.root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                node.children[tokens[depth]] = _Node(tokens[depth:], now, pid)
                return
            k = _shared(child.edge, tokens, depth)
            if k < len(child.edge):
                mid = _Node(child.edge[:k], child.last, child.owner)
                child.edge = child.edge[k:]
                mid.children[child.edge[0]] = child
                node.children[tokens[depth]] = child = mid
            if now >= child.last:  # a prompt joining late (once ready) keeps later uses the latest
                child.last, child.owner = now, pid
            node, depth = child, depth + k
