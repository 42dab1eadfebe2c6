"""Where every prompt token went (docs/design.md §15): the cache's own attach splits each prompt
into parts that add up to it, on a storage-free page manager (the replay's) and the real cache."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager, Session
from engine.disk_tier import DiskTier
from engine.prefix_cache import PrefixCache
from engine.token_parts import KEYS, PARTS, SeenIndex, TokenParts

ROWS = 4


class Run:
    """The scheduler's calls on a bare page manager: attach (accounted), compute, insert, release."""

    def __init__(self, budget: int = 0, disk: int = 0, seen_pages: int = 1 << 12):
        self.pages = BlockManager(page_rows=ROWS)
        self.cache = PrefixCache(max_pages=budget, tier=DiskTier(disk) if disk else None,
                                 seen_pages=seen_pages)
        self.cache.bind(self.pages)
        self.ids = 0

    def request(self, prompt: list[int], namespace: str = "", answer=(0, 0, 0)):
        """Run one request; it donates its prompt and `answer`, as a finished stream does."""
        self.ids += 1
        self.cache.actor = self.ids
        s = Session(self.pages)
        m, account, tenant = self.cache.attach_accounted(self.pages, s, prompt, namespace)
        done = prompt + list(answer)
        self.pages.allocate([s], [len(done) - m])
        self.pages.commit([s], [done[m:]])
        self.cache.insert(self.pages, s, done, namespace=namespace)
        s.release()
        self.cache.actor = None
        assert account.parts.cached == m
        return account, tenant


def check(parts: TokenParts, n: int) -> None:
    assert parts.total == n, parts
    assert all(v >= 0 for v in parts.as_dict().values()), parts
    assert parts.disk <= parts.cached


SYSTEM = list(range(100, 112))          # three whole pages


def test_cold_then_shared_system_prompt_then_repeat():
    run = Run()
    a, _ = run.request(SYSTEM + [1, 2, 3, 4, 5])
    assert a.parts == TokenParts(new=17) and a.diverged_at is None and a.diverged_from is None
    # B shares the three system pages and the first two tokens of the fourth page
    b, _ = run.request(SYSTEM + [1, 2, 9, 9, 9])
    assert b.parts == TokenParts(cached=12, rounding=2, new=3)
    assert (b.diverged_at, b.diverged_from) == (14, 1)
    assert b.diverged_at - b.parts.cached == b.parts.rounding
    # an exact repeat of A: all cached but what the attach cap keeps back
    c, _ = run.request(SYSTEM + [1, 2, 3, 4, 5])
    assert c.parts == TokenParts(cached=16, cap=1) and c.diverged_at == 17
    # a repeat of a page-aligned prompt keeps back a whole page
    d, _ = run.request(SYSTEM + [1, 2, 3, 4])
    assert d.parts == TokenParts(cached=12, cap=4)


def test_another_namespace_is_isolated_for_the_operator_and_new_for_the_tenant():
    run = Run()
    run.request(SYSTEM + [1, 2, 3, 4, 5])
    op, tenant = run.request(SYSTEM + [1, 2, 3, 4, 5], namespace="bob")
    assert op.parts == TokenParts(isolated=16, rounding=1)
    assert (op.diverged_at, op.diverged_from) == (17, 1)
    assert tenant.parts == TokenParts(new=17)
    assert (tenant.diverged_at, tenant.diverged_from) == (None, None)
    assert op.parts.private() == TokenParts(new=16, rounding=1)   # privacy folds isolated only


def test_evicted_names_the_budget_and_the_request():
    run = Run(budget=4)
    run.request(SYSTEM + [1, 2, 3, 4, 5])                     # request 1: 4 pages
    run.request([7] * 16 + [8])                               # request 2 evicts them
    again, tenant = run.request(SYSTEM + [1, 2, 3, 4, 5])
    assert again.parts == TokenParts(evicted=16, rounding=1) == tenant.parts
    ev = again.evicted_by
    assert (ev.cause, ev.budget_pages, ev.request) == ("budget", 4, 2)
    assert "budget of 4 pages" in ev.describe()


def test_disk_tier_pages_count_in_disk():
    run = Run(budget=4, disk=16)
    run.request(SYSTEM + [1, 2, 3, 4, 5])
    run.request([7] * 16 + [8])                               # demotes request 1's pages
    again, _ = run.request(SYSTEM + [1, 2, 3, 4, 5])
    # the tail's page stays on disk (an attach loads only what it attaches): held, capped
    assert again.parts == TokenParts(cached=16, disk=16, cap=1)
    assert run.cache.counters.disk_hit_pages == 4


def test_past_the_index_reach_a_page_is_new():
    run = Run(budget=1, seen_pages=2)
    run.request(SYSTEM + [1])
    for i in range(4):
        run.request([50 + i] * 8 + [1])                       # pushes SYSTEM's pages out of reach
    again, _ = run.request(SYSTEM + [1])
    assert again.parts == TokenParts(new=13)


def test_seen_index_is_bounded_and_validated():
    idx = SeenIndex(3)
    for k in range(10):
        idx.saw(k, None, (k, 0), "", k, k)
    assert len(idx) == 3 and sorted(idx.pages) == [7, 8, 9]
    assert sum(map(len, idx.children.values())) == 3
    try:
        SeenIndex(0)
    except ValueError as e:
        assert "at least 1 page" in str(e)
    else:
        raise AssertionError("SeenIndex(0) was accepted")


def test_parts_names_and_round_trip():
    assert set(PARTS) | {"disk"} == set(KEYS)
    p = TokenParts(cached=8, disk=4, new=3)
    assert TokenParts.from_dict(p.as_dict()) == p and p.total == 11


prompts = st.lists(st.integers(0, 2), min_size=1, max_size=14)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(prompts, st.sampled_from(["", "", "t"])), min_size=1, max_size=12),
       st.integers(0, 6), st.integers(0, 4), st.integers(1, 40))
def test_parts_always_add_up_to_the_prompt(reqs, budget, disk, seen_pages):
    """Whatever the traffic, budget, disk tier and index size: the parts add up, none negative,
    and the tenant's view never counts another namespace."""
    run = Run(budget=budget, disk=disk, seen_pages=seen_pages)
    for prompt, ns in reqs:
        op, tenant = run.request(prompt, ns)
        check(op.parts, len(prompt))
        check(tenant.parts, len(prompt))
        assert tenant.parts.isolated == 0
        for acc in (op, tenant):
            if acc.diverged_at is not None:
                assert 0 < acc.diverged_at <= len(prompt)
                assert acc.diverged_at >= acc.parts.cached + acc.parts.lent


def test_the_scheduler_counts_pages_shared_in_flight_as_lent(tiny_model):
    """Prompts submitted together: the first computes the shared pages, the others borrow them
    in the same pass (engine/lending.py) and count them `lent`; the FinishEvent carries the parts."""
    from engine.loop import EngineLoop
    from engine.scheduler import FinishEvent, SchedulerSettings
    from tests.loop_helpers import Heard

    shared = list(range(100, 164))                       # 4 pages of 16, uncached at the start
    prompts = [shared + [5, 6, 7, 8], shared + [5, 6, 9], shared + [12, 13]]
    heard = Heard(EngineLoop(tiny_model, SchedulerSettings(page_rows=16)))
    ids = [heard.submit(prompt=p, max_new_tokens=3, stop_ids=[]) for p in prompts]
    finished = {}
    while heard.loop.has_work():
        finished.update({ev.request_id: ev for ev in heard.step() if isinstance(ev, FinishEvent)})
    owner, near, far = (finished[i] for i in ids)
    assert owner.parts == TokenParts(new=68) and owner.record.diverged_at is None
    assert near.parts == TokenParts(lent=64, rounding=2, new=1)   # shares 66 tokens with the owner
    assert (near.record.diverged_at, near.record.diverged_from) == (66, ids[0])
    assert far.parts == TokenParts(lent=64, new=2) and far.record.diverged_from == ids[0]
    for ev in finished.values():
        assert ev.parts.cached + ev.parts.lent == ev.record.n_cached


def test_a_tenants_departure_never_depends_on_another_namespaces_pages():
    """Another namespace's pages sorting between a tenant's prompt and its own page must not hide
    where it departs (that would tell the tenant of the other's traffic)."""
    def bob_after(alice_requests: int):
        run = Run()
        run.request(SYSTEM + [1, 2, 3, 500, 7], namespace="bob")
        for x in range(alice_requests):   # fourth pages that sort between Bob's query and his page
            run.request(SYSTEM + [1, 2, 3, 10 + x, 7], namespace="alice")
        return run.request(SYSTEM + [1, 2, 3, 5, 7], namespace="bob")[1]

    alone = bob_after(0)
    assert alone.parts == TokenParts(cached=12, rounding=3, new=2) and alone.diverged_at == 15
    assert bob_after(100) == alone


def test_each_namespaces_sorted_children_follow_the_index_bound():
    idx = SeenIndex(3)
    for k in range(10):
        idx.saw(k, None, (k, 0), "ab"[k % 2], k, k)
    idx.saw(9, None, (9, 0), "a", 9, 9)                       # page 9 in both namespaces
    assert sorted(idx.pages) == [7, 8, 9]
    assert {key: [f for _, f in kids] for key, kids in idx.own.items()} == {
        (None, "a"): [8, 9], (None, "b"): [7, 9]}
    assert idx.nearest(None, (7, 5), "a") == (0, None) and idx.nearest(None, (7, 5), "b")[0] == 1
    for k in (10, 11, 12):
        idx.saw(k, None, (k, 0), "a", k, k)
    assert {key: [f for _, f in kids] for key, kids in idx.own.items()} == {(None, "a"): [10, 11, 12]}
