"""One line per provider: what would make its cache work on this traffic, and what that buys
(the Advisor tab's rows, `prefixlab advise`'s text). Plain data in, words out."""

from __future__ import annotations

from dataclasses import replace

from .prompts import Prompt
from .rules import RuleSet
from .simulate import simulate, totals
from .whatif import fixed_traffic


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
    return (f"{first}add {where}: {before['token_hit_ratio']:.0%} -> {after['token_hit_ratio']:.0%} "
            f"cached, {_money(before['cost_with'] - after['cost_with'])} saved")


def provider_hint(rule_result: dict, rules: RuleSet, requests, prompts: list[Prompt],
                  what_if: dict | None, fixed: tuple | None = None) -> str:
    """What would make this provider's cache work here, in one line."""
    t = rule_result["totals"]
    if rules.breakpoints and not any(p.marks for p in prompts):
        return breakpoint_hint(rules, requests, prompts, t, fixed)
    shared = sorted(r["common_prefix_tokens"] for r in rule_result["requests"][1:])
    median = shared[len(shared) // 2] if shared else 0
    fix = next((r for r in (what_if or {}).get("rule_sets", []) if r["name"] == rules.name), None)
    if fix and fix["after"]["cached_tokens"] > fix["before"]["cached_tokens"]:
        gain = fix["before"]["cost_with"] - fix["after"]["cost_with"]
        return (f"{what_if['fix']}: {fix['before']['token_hit_ratio']:.0%} -> "
                f"{fix['after']['token_hit_ratio']:.0%} cached, {_money(gain)} saved")
    if median and median < rules.min_prefix_tokens:
        return (f"requests share ~{median:,} tokens, under its {rules.min_prefix_tokens:,}-token minimum: "
                "a longer common start (system prompt, tools) would cache")
    if t["token_hit_ratio"] > 0:
        return f"caches {t['token_hit_ratio']:.0%} of the prompt tokens as the traffic is"
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
