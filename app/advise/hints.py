"""One line per provider: what would make its cache work on this traffic, and what that buys
(the Advisor tab's rows, `prefixlab advise`'s text). Plain data in, words out."""

from __future__ import annotations

import bisect
import math
from dataclasses import replace

from .prompts import Prompt
from .rules import RuleSet
from .simulate import simulate, totals
from .whatif import fixed_traffic

Option = tuple[float, str] | None  # (money saved, the line), or None: not a change for this traffic


def _system_end(prompt: Prompt) -> int:
    """Tokens up to the end of the prompt's first message (its system prompt), or 0."""
    first = next((s for s in prompt.segments if s.message == 0), None)
    return prompt.tokens_before(first.end) if first is not None else 0


def _money(v: float) -> str:
    return f"${v:,.4f}" if abs(v) < 100 else f"${v:,.2f}"


def _marked(rules: RuleSet, requests, prompts: list[Prompt]) -> dict:
    marked = [replace(p, marks=[_system_end(p)] if _system_end(p) else []) for p in prompts]
    return totals(simulate(rules, requests, marked))


def breakpoint_hint(rules: RuleSet, requests, prompts: list[Prompt], before: dict,
                    fixed: tuple | None = None) -> str:
    """Rules that cache only at cache_control marks, on traffic without one: where a mark would go
    (the end of the system prompt every request starts with) and what it would buy, simulated;
    with the what-if's fix first when the system prompt itself diverges (`fixed`: its requests,
    prompts and words)."""
    where = "a cache_control breakpoint at the end of the system prompt (message 0)"
    after, first = _marked(rules, requests, prompts), ""
    if after["cached_tokens"] <= before["cached_tokens"] and fixed is not None:
        after, first = _marked(rules, fixed[0], fixed[1]), f"{fixed[2]}, then "
    if after["cached_tokens"] <= before["cached_tokens"]:
        return f"caches only at cache_control breakpoints; {where} would not help here"
    return f"{first}add {where}: {_bought(before, after)}"


def _bought(before: dict, after: dict) -> str:
    return (f"{before['token_hit_ratio']:.0%} -> {after['token_hit_ratio']:.0%} cached, "
            f"{_money(before['cost_with'] - after['cost_with'])} saved")


def added_mark_hint(rules: RuleSet, requests, prompts: list[Prompt], before: dict) -> Option:
    """Marked traffic whose shared prefix is not read (no earlier request wrote where this one
    looks: a mark too far past the last written one, or none on the system prompt): one more
    mark at the end of the system prompt, within the 4 allowed, simulated."""
    if not rules.breakpoints or not before.get("parts", {}).get("no_breakpoint"):
        return None
    more = []
    for p in prompts:
        end = _system_end(p)
        if not end or end in p.marks or len(p.marks) >= rules.max_marks:
            more.append(p)
            continue
        marks = sorted([*p.marks, end])
        long = [p.long[p.marks.index(m)] if m in p.marks and p.marks.index(m) < len(p.long) else False
                for m in marks]
        more.append(replace(p, marks=marks, long=long))
    after = totals(simulate(rules, requests, more))
    gain = before["cost_with"] - after["cost_with"]
    return (gain, f"add a cache_control breakpoint at the end of the system prompt (message 0), beside "
                  f"the ones there: {_bought(before, after)}") if gain > 0 else None


def longer_life_hint(rules: RuleSet, requests, prompts: list[Prompt], before: dict) -> Option:
    """Prompts that expired between uses: the long lifetime (Anthropic's "ttl": "1h" at its write
    price, OpenAI's prompt_cache_retention "24h"), simulated on this traffic."""
    if not rules.long_ttl_seconds or not before.get("parts", {}).get("expired"):
        return None
    life = f"{rules.long_ttl_seconds / 3600:g}-hour"
    if rules.breakpoints:
        if not any(p.marks for p in prompts):
            return None
        after = totals(simulate(rules, requests, [replace(p, long=[True] * len(p.marks)) for p in prompts]))
        how = f"\"ttl\": \"1h\" on the cache_control marks (writes at {_money(rules.prices.write(True))}/M)"
    else:
        after = totals(simulate(rules, [replace(r, long_retention=True) for r in requests], prompts))
        how = "prompt_cache_retention = \"24h\""
    gain = before["cost_with"] - after["cost_with"]
    return (gain, f"prompts expire between uses: the {life} lifetime ({how}): {_bought(before, after)}") \
        if gain > 0 else None


def spread_keys_hint(rules: RuleSet, requests, prompts: list[Prompt], before: dict) -> Option:
    """Overflow past the per-minute rate of one prefix and key: that many prompt_cache_key values
    (per user or app) keep each under it, simulated."""
    if not before.get("parts", {}).get("overflow") or not rules.overflow_per_minute:
        return None
    times = sorted(r.arrival_s for r in requests)
    peak = max(bisect.bisect_right(times, t + 60.0) - k for k, t in enumerate(times))
    n = math.ceil(peak / rules.overflow_per_minute)
    spread = [replace(r, key=f"{r.key}/{k % n}") for k, r in enumerate(requests)]
    after = totals(simulate(rules, spread, prompts))
    gain = before["cost_with"] - after["cost_with"]
    return (gain, f"{before['parts']['overflow']:,} tokens overflowed to cold machines past "
                  f"~{rules.overflow_per_minute} requests a minute: set prompt_cache_key per user or app "
                  f"({n} keys at this traffic's peak of {peak} a minute): {_bought(before, after)}") \
        if gain > 0 else None


def explicit_cache_hint(rules: RuleSet, rule_result: dict, requests) -> Option:
    """A provider with explicit caches billed by storage (Gemini): the prefix most requests share,
    cached explicitly for the trace's span (at least the default hour), against the cost now.
    An estimate: every request is assumed to read that prefix."""
    storage = rules.prices.storage_per_million_hour
    rows = rule_result["requests"]
    if storage is None or len(rows) < 2:
        return None
    # what each request shares with any earlier one, expired or not: all but its new tokens
    shared = sorted(r["prompt_tokens"] - r.get("parts", {}).get("new", 0) for r in rows[1:])
    shared = shared[len(shared) // 2]
    if shared < rules.min_prefix_tokens:
        return None
    hours = max(1.0, (requests[-1].arrival_s - requests[0].arrival_s) / 3600)
    p, before = rules.prices, rule_result["totals"]
    after = (shared * storage * hours + shared * p.input
             + sum(min(shared, r["prompt_tokens"]) * p.cached_input
                   + max(0, r["prompt_tokens"] - shared) * p.input + r["output_tokens"] * p.output
                   for r in rows)) / 1e6
    gain = before["cost_with"] - after
    return (gain, f"an explicit cache of the first {shared:,} tokens for {hours:.1f} h (storage "
                  f"{_money(shared * storage * hours / 1e6)}): {_money(gain)} saved (estimate)") \
        if gain > 0 else None


def provider_hint(rule_result: dict, rules: RuleSet, requests, prompts: list[Prompt],
                  what_if: dict | None, fixed: tuple | None = None) -> str:
    """The change that pays most on this traffic for this provider, and what it buys, in one line."""
    t = rule_result["totals"]
    if rules.breakpoints and not any(p.marks for p in prompts):
        return breakpoint_hint(rules, requests, prompts, t, fixed)
    options = []
    fix = next((r for r in (what_if or {}).get("rule_sets", []) if r["name"] == rules.name), None)
    if fix and fix["after"]["cached_tokens"] > fix["before"]["cached_tokens"]:
        gain = fix["before"]["cost_with"] - fix["after"]["cost_with"]
        options.append((gain, f"{what_if['fix']}: {fix['before']['token_hit_ratio']:.0%} -> "
                              f"{fix['after']['token_hit_ratio']:.0%} cached, {_money(gain)} saved"))
    options += [o for o in (added_mark_hint(rules, requests, prompts, t),
                            longer_life_hint(rules, requests, prompts, t),
                            spread_keys_hint(rules, requests, prompts, t),
                            explicit_cache_hint(rules, rule_result, requests)) if o is not None]
    if options:  # the one that saves most (the fix first when nothing is priced: a local engine)
        return max(enumerate(options), key=lambda o: (o[1][0], -o[0]))[1][1]
    shared = sorted(r["common_prefix_tokens"] for r in rule_result["requests"][1:])
    median = shared[len(shared) // 2] if shared else 0
    minimum = rules.min_for(requests[0].model) if requests else rules.min_prefix_tokens
    if median and median < minimum:
        return (f"requests share ~{median:,} tokens, under its {minimum:,}-token minimum: "
                "a longer common start (system prompt, tools) would cache")
    if t["token_hit_ratio"] > 0:
        return f"caches {t['token_hit_ratio']:.0%} of the prompt tokens as the traffic is"
    if t.get("parts", {}).get("expired"):
        return (f"prompts shared with earlier ones expire first (its lifetime: {rules.ttl_seconds / 60:g} "
                "minutes): send them closer together")
    return "no two requests share a prefix it could cache"


def hints(advice: dict, rule_sets: list[RuleSet], requests, prompts_of) -> dict[str, str]:
    """`prompts_of(tokenizer_name, requests)`: the requests' Prompts under that tokenizer.
    Rule set name -> one line."""
    target = next((g for g in advice["groups"] if not g["expected"]), None)
    fixed_requests = fixed_traffic(requests, target) if target is not None else None
    out = {}
    for res in advice["rule_sets"]:
        rules = next(r for r in rule_sets if r.name == res["rules"]["name"])
        fixed = None
        if rules.breakpoints and fixed_requests is not None:
            fixed = (fixed_requests, prompts_of(rules.tokenizer, fixed_requests), advice["what_if"]["fix"])
        out[rules.name] = provider_hint(res, rules, requests, prompts_of(rules.tokenizer, requests),
                                        advice.get("what_if"), fixed)
    return out
