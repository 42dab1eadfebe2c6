"""Routers in front of a cluster's replicas (docs/design.md §13): which replica serves a request.

A router sees, per replica, the prefix it has cached for this request (`cached`:
blocks a precise prefix-cache lookup would attach) and its load (`load`:
outstanding tokens of work; `decoding`: KV blocks of the requests it is running),
and returns a replica index. Ties go to the lowest index, so every router is
deterministic given its inputs (random: given its seed).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

ROUTERS = ("round-robin", "prefix-hash", "random", "least-loaded", "cache-aware", "kv-cost")
# Routers whose choice needs each replica's cached prefix (a lookup per replica per request).
CACHE_ROUTERS = ("cache-aware", "kv-cost")


@dataclass(frozen=True)
class RouterKnobs:
    """The load-aware routers' constants: SGLang's balance thresholds, Dynamo's overlap weight."""

    seed: int = 0
    balance_abs: int = 32_768     # tokens: cache-aware balances when the gap exceeds this ...
    balance_rel: float = 1.5      # ... and the busiest carries this many times the idlest's load
    overlap_weight: float = 1.0   # kv-cost: weight of the blocks a replica would have to prefill
    hash_balance: float = 1.25    # prefix-hash: a replica takes a request only while its load, the
    #                               request's added, stays within this many times the mean (HAProxy's
    #                               hash-balance-factor 125); 0: never overflow


@dataclass
class View:
    """What a router sees of the replicas when a request arrives."""

    index: int                    # the request's position in the trace (0-based)
    first_key: int                # the key of the request's first block (prefix-hash)
    blocks: int                   # the request's prompt blocks
    tokens: int                   # the request's prompt tokens (prefix-hash's overflow weighs them)
    cached: list[int]             # per replica: blocks it would attach (CACHE_ROUTERS only)
    load: list[float]             # per replica: outstanding tokens of work
    decoding: list[int]           # per replica: KV blocks of the requests it is running


Router = Callable[[View], int]


def check_routers(names) -> list[str]:
    """The names, or ValueError naming the first unknown one."""
    names = list(names)
    bad = [n for n in names if n not in ROUTERS]
    if bad or not names:
        raise ValueError(f"unknown router {bad[0] if bad else ''!r}; one of {', '.join(ROUTERS)}")
    return names


def make_router(name: str, replicas: int, knobs: RouterKnobs = RouterKnobs()) -> Router:
    """A fresh router (its own state: the random one's generator) for `replicas` replicas."""
    check_routers([name])
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    n = replicas
    if name == "round-robin":
        return lambda v: v.index % n
    if name == "prefix-hash":
        return lambda v: _prefix_hash(v, knobs.hash_balance)
    if name == "random":
        rng = random.Random(knobs.seed)
        return lambda v: rng.randrange(n)
    if name == "least-loaded":
        return lambda v: _argmin(v.load)
    if name == "cache-aware":
        return lambda v: _cache_aware(v, knobs)
    w = knobs.overlap_weight  # Dynamo: overlap_weight x blocks to prefill + blocks being decoded
    return lambda v: _argmin([w * (v.blocks - c) + d for c, d in zip(v.cached, v.decoding)])


def _argmin(values) -> int:
    return min(range(len(values)), key=values.__getitem__)


def _prefix_hash(v: View, balance: float) -> int:
    """OpenAI's routing as its prompt-caching guide describes it (platform.openai.com/docs/
    guides/prompt-caching, 2026): a hash of about the first 256 tokens (and prompt_cache_key)
    picks the machine, and past about 15 requests a minute for one prefix and key requests
    overflow to other machines. The overflow is modelled as consistent hashing with bounded
    loads (Mirrokni, Thorup and Zadimoghaddam 2018; HAProxy's hash-balance-factor): the hash's
    replica, else the next in order whose load with this request's tokens added stays within
    `balance` times the mean (an idle one always qualifies), else the least loaded. The rate
    threshold is OpenAI's machines', not a replica of this engine's, so the bound is on load,
    not on a rate."""
    n = len(v.load)
    home = v.first_key % n
    if balance <= 0:
        return home
    # the mean with this request's tokens added; an idle replica always takes one request (as
    # the unit-weight rule's ceiling does: a capacity is never under one item)
    bound = max(balance * (sum(v.load) + v.tokens) / n, v.tokens)
    for k in range(n):
        j = (home + k) % n
        if v.load[j] + v.tokens <= bound:
            return j
    return _argmin(v.load)


def _cache_aware(v: View, knobs: RouterKnobs) -> int:
    """SGLang's router: the longest cached prefix (ties: the least loaded), unless the load is
    out of balance by both thresholds, then the least loaded."""
    hi, lo = max(v.load), min(v.load)
    if hi - lo > knobs.balance_abs and hi > lo * knobs.balance_rel:
        return _argmin(v.load)
    return min(range(len(v.cached)), key=lambda i: (-v.cached[i], v.load[i], i))
