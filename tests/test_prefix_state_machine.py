"""Random create/eval/insert/attach/release/evict/flush sequences against the prefix cache.

A hypothesis state machine per page size (1, 2, 4), over bounded and growing pools,
cache budgets, the leaves-only eviction policies and a hash with only three buckets.
After every step: the pool's counts are exact, every reference is accounted for,
shared or cached pages never change, every session sees exactly the K/V of the tokens
it evaluated or attached, and every cached page holds the K/V of its own prefix.
Teardown must leave the pool empty.
"""

from __future__ import annotations

import hashlib

import numpy as np
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import engine as dl

from .prefix_helpers import (
    assert_cache_consistent,
    assert_same,
    assert_session_sees,
    evictable_pages,
    fake_eval,
    make_pool,
    teardown,
)

# Prompts share system prompts of several lengths, then a short random question.
SYSTEMS = [list(range(100, 107)), list(range(100, 112)), list(range(100, 104)) + [300, 301, 302]]
MAX_SESSIONS = 5


def few_buckets(b: bytes) -> int:
    return hashlib.blake2b(b, digest_size=8).digest()[0] % 3


prompts = st.builds(lambda sys, q: sys + q, st.sampled_from(SYSTEMS),
                    st.lists(st.integers(0, 3), min_size=0, max_size=6))


class PrefixCacheMachine(RuleBasedStateMachine):
    page_rows = 2

    @initialize(pool_pages=st.sampled_from([None, 8, 16, 40]),
                budget=st.sampled_from([0, 0, 3, 8]),
                hashed=st.sampled_from(["blake2b", "blake2b", "few_buckets"]),
                policy=st.sampled_from(["leaf-lru", "leaf-lru", "lfu", "fifo"]))  # leaves-only policies
    def setup(self, pool_pages, budget, hashed, policy):
        rows = self.page_rows
        max_pages = None if pool_pages is None else max(4, pool_pages // rows)
        self.pool = make_pool(rows, max_pages)
        self.cache = dl.create_prefix_cache(
            max_pages=budget, hash_fn=few_buckets if hashed == "few_buckets" else None, policy=policy)
        self.exact_hash = hashed == "blake2b"
        self.sessions: list[dl.Session] = []
        self.prompt: dict[int, list[int]] = {}
        self.namespace: dict[int, str] = {}
        self.snapshots: dict[int, tuple[bytes, bytes]] = {}
        self.flushed = 0
        alloc = self.pool.alloc

        def alloc_fresh() -> int:
            page = alloc()
            self.snapshots.pop(page, None)  # a new life for this page: it may be written
            return page

        self.pool.alloc = alloc_fresh

    # rules ---------------------------------------------------------------

    def _open(self, prompt, use_cache, namespace) -> dl.Session:
        s = dl.Session(pool=self.pool)
        self.sessions.append(s)
        self.prompt[s.id], self.namespace[s.id] = prompt, namespace
        if use_cache:
            self._attach(s, prompt, namespace)
        return s

    def _attach(self, s, prompt, namespace) -> None:
        probe = dl.prefix_probe(self.cache, prompt, namespace)
        before = vars(self.cache.counters).copy()
        n = dl.prefix_attach(self.cache, self.pool, s, prompt, namespace)
        event(f"attach: {probe.stop_reason}, {'hit' if n else 'no hit'}")
        rows = self.pool.page_rows
        assert n == probe.matched_tokens and n % rows == 0 and n <= len(prompt) - 1
        assert len(s.page_table) == n // rows and s.n_past == n
        assert s.tokens == prompt[:n]
        after = vars(self.cache.counters)
        assert after["queries"] == before["queries"] + 1
        assert after["hits"] == before["hits"] + (n > 0)
        assert after["tokens_saved"] == before["tokens_saved"] + n
        if probe.stop_reason == "cap":
            assert n == (len(prompt) // rows - 1) * rows
        with_cache = {e.page for e in self.cache.pages.values() if e.namespace == namespace}
        assert set(s.page_table) <= with_cache

    def _eval(self, s, tokens) -> bool:
        before = (s.page_table, s.tokens)
        try:
            fake_eval(s, tokens)
        except dl.PoolExhausted as e:
            event("eval: PoolExhausted")
            rows = self.pool.page_rows
            needed = -(-(s.n_past + len(tokens)) // rows) - len(s.page_table)
            assert self.pool.max_pages is not None and needed > self.pool.num_free_pages
            assert evictable_pages(self.cache, self.pool) == [], "raised with pages to evict"
            assert "nothing it can evict" in str(e)
            assert (s.page_table, s.tokens) == before, "a refused eval kept pages"
            return False
        return True

    def _insert(self, s, tokens) -> None:
        ns = self.namespace[s.id]
        n_pages, n_evicted = len(self.cache.pages), self.cache.counters.evicted_pages
        added = dl.prefix_insert(self.cache, self.pool, s, tokens, f"s{s.id}", ns)
        evicted = self.cache.counters.evicted_pages - n_evicted
        event(f"insert: {'added' if added else 'nothing new'}{', evicted' if evicted else ''}")
        assert added == len(self.cache.pages) - n_pages + evicted
        full = min(len(tokens), s.n_past) // self.pool.page_rows
        assert added <= full
        if self.cache.max_pages and len(self.cache.pages) > self.cache.max_pages:
            assert evictable_pages(self.cache, self.pool) == [], "over budget with pages to evict"
        if self.exact_hash and not self.cache.max_pages and full:
            probe = dl.prefix_probe(self.cache, tokens[:full * self.pool.page_rows] + [0], ns)
            assert probe.matched_pages == full      # every full page is now cached

    @rule(prompt=prompts, use_cache=st.sampled_from([True, True, True, False]),
          namespace=st.sampled_from(["", "", "other"]), split=st.integers(1, 12),
          answer=st.lists(st.integers(0, 3), min_size=0, max_size=4),
          donate=st.sampled_from([True, True, True, False]), keep=st.booleans())
    def serve(self, prompt, use_cache, namespace, split, answer, donate, keep):
        """A whole request: attach, prefill the tail in two chunks, decode, donate, release."""
        s = self._open(prompt, use_cache, namespace)
        tail = prompt[s.n_past:]
        ok = all(self._eval(s, part) for part in (tail[:split], tail[split:]) if part)
        if ok:
            for t in answer:
                if not self._eval(s, [t]):
                    break
        if donate and s.n_past:
            self._insert(s, s.tokens)
        if not keep or len(self.sessions) > MAX_SESSIONS:
            self.sessions.remove(s)
            dl.release_kv_pages(s)

    @precondition(lambda self: len(self.sessions) < MAX_SESSIONS)
    @rule(prompt=prompts, use_cache=st.booleans(), namespace=st.sampled_from(["", "", "other"]))
    def create(self, prompt, use_cache, namespace):
        self._open(prompt, use_cache, namespace)

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, MAX_SESSIONS - 1), chunk=st.integers(1, 8),
          extra=st.lists(st.integers(0, 3), min_size=1, max_size=3))
    def eval(self, i, chunk, extra):
        s = self.sessions[i % len(self.sessions)]
        rest = self.prompt[s.id][s.n_past:]
        self._eval(s, rest[:chunk] if rest else extra)    # prefill, then "decode"

    @precondition(lambda self: any(s.n_past for s in self.sessions))
    @rule(i=st.integers(0, MAX_SESSIONS - 1), how=st.sampled_from(["all", "longer", "shorter"]),
          cut=st.integers(0, 20))
    def insert(self, i, how, cut):
        done = [s for s in self.sessions if s.n_past]
        s = done[i % len(done)]
        tokens = {"all": s.tokens, "longer": s.tokens + [1, 2, 3], "shorter": s.tokens[:cut]}[how]
        self._insert(s, tokens)

    @precondition(lambda self: any(s.n_past for s in self.sessions))
    @rule(i=st.integers(0, MAX_SESSIONS - 1), pos=st.integers(0, 30))
    def insert_wrong_tokens(self, i, pos):
        done = [s for s in self.sessions if s.n_past]
        s = done[i % len(done)]
        wrong = list(s.tokens)
        wrong[pos % len(wrong)] += 1000
        keys = set(self.cache.pages)
        try:
            dl.prefix_insert(self.cache, self.pool, s, wrong, "wrong", self.namespace[s.id])
        except ValueError as e:
            assert f"position {pos % len(wrong)}" in str(e)
        else:
            raise AssertionError("insert accepted tokens the session did not evaluate")
        assert set(self.cache.pages) == keys

    @precondition(lambda self: any(s.n_past or s.page_table for s in self.sessions))
    @rule(i=st.integers(0, MAX_SESSIONS - 1))
    def attach_needs_fresh(self, i):
        used = [s for s in self.sessions if s.n_past or s.page_table]
        s = used[i % len(used)]
        queries = self.cache.counters.queries
        try:
            dl.prefix_attach(self.cache, self.pool, s, self.prompt[s.id], self.namespace[s.id])
        except ValueError as e:
            assert "fresh session" in str(e)
        else:
            raise AssertionError("attach accepted a session that is not fresh")
        assert self.cache.counters.queries == queries

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, MAX_SESSIONS - 1))
    def release(self, i):
        s = self.sessions.pop(i % len(self.sessions))
        dl.release_kv_pages(s)

    @rule(k=st.integers(0, 4), flush=st.sampled_from([False, False, False, True]))
    def evict(self, k, flush):
        if flush:
            n = len(self.cache.pages)
            assert dl.prefix_release(self.cache, self.pool) == n
            self.flushed += n
            assert dl.prefix_held_groups(self.cache) == 0 and dl.prefix_chain_list(self.cache) == []
            return
        n = self.cache.evict(k)
        event(f"evict: {'all asked' if n == k else 'fewer'}")
        assert 0 <= n <= k
        if n < k:
            assert evictable_pages(self.cache, self.pool) == []

    # invariants ------------------------------------------------------------

    @invariant()
    def pool_counts_are_exact(self):
        self.pool.check()
        expected = np.zeros(self.pool.capacity, dtype=np.int64)
        for s in self.sessions:
            np.add.at(expected, np.asarray(s.page_table, dtype=np.int64), 1)
        np.add.at(expected, np.asarray(list(self.cache.by_page), dtype=np.int64), 1)
        assert_same(self.pool.refcount, expected)

    @invariant()
    def shared_pages_never_change(self):
        shared = set(self.cache.by_page)
        for s in self.sessions:
            shared.update(p for p in s.page_table if self.pool.refcount[p] > 1)
        for p in shared:
            now = (self.pool.k[:, p].tobytes(), self.pool.v[:, p].tobytes())
            assert self.snapshots.setdefault(p, now) == now, f"shared page {p} was written"
        for p in set(self.snapshots) - shared:
            del self.snapshots[p]    # private or free again: it may be written now

    @invariant()
    def sessions_see_their_tokens(self):
        for s in self.sessions:
            prompt = self.prompt[s.id]
            assert s.tokens[:len(prompt)] == prompt[:s.n_past]
            assert_session_sees(s, s.tokens)

    @invariant()
    def cache_is_consistent(self):
        assert_cache_consistent(self.cache, self.pool)
        c = self.cache.counters
        assert c.inserted_pages == len(self.cache.pages) + c.evicted_pages + self.flushed
        assert c.hits <= c.queries and c.tokens_saved == c.hit_pages * self.pool.page_rows
        assert all(ch.pages_live > 0 for ch in dl.prefix_chain_list(self.cache))
        if self.cache.max_pages and len(self.cache.pages) > self.cache.max_pages:
            # the budget holds whenever pages can be given back (after releases too)
            assert evictable_pages(self.cache, self.pool) == [], "over budget with pages to evict"

    def teardown(self):
        teardown(self.sessions, self.cache, self.pool)


SETTINGS = settings(max_examples=120, stateful_step_count=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow],
                    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])


class Rows1(PrefixCacheMachine):
    page_rows = 1


class Rows2(PrefixCacheMachine):
    page_rows = 2


class Rows4(PrefixCacheMachine):
    page_rows = 4


TestRows1 = Rows1.TestCase
TestRows1.settings = SETTINGS
TestRows2 = Rows2.TestCase
TestRows2.settings = SETTINGS
TestRows4 = Rows4.TestCase
TestRows4.settings = SETTINGS
