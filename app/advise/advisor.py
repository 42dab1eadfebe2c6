"""The advice for a trace: per rule set the simulation, then the divergence groups and the what-if
(docs/design.md §14); plain data, the JSON `prefixlab advise --json` writes.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from .divergence import find_divergences, group
from .prompts import build_prompt, build_prompts
from .rules import RuleSet
from .simulate import scaled, simulate, totals, usage_scale
from .tokens import ENCODINGS, EncodingTokenizer
from .traffic import Request
from .whatif import describe, fixed_traffic

SCHEMA = "prefixlab.advice/2"  # /2: read/write/uncached split, parts, upstream error; /1 still reads


class RenderError(ValueError):
    """Requests a tokenizer's chat template cannot render: `failures` is [(request, why)]."""

    def __init__(self, failures: list[tuple[Request, str]]):
        request, why = failures[0]
        super().__init__(f"line {request.line}: cannot render the chat messages: {why}")
        self.failures = failures


class Tokenizers:
    """Tokenizers by rule-set name ("model": the loaded one), and each request's prompt under each."""

    def __init__(self, model_tokenizer, load: Callable[[str], object] | None = None):
        self._toks = {"model": model_tokenizer}
        self._load = load

    def get(self, name: str):
        if name not in self._toks and name in ENCODINGS:  # a provider's own, shipped
            self._toks[name] = EncodingTokenizer(name)
        if name not in self._toks:
            if self._load is None:
                raise ValueError(f"no tokenizer {name!r} (only the loaded model's)")
            self._toks[name] = self._load(name)
        return self._toks[name]

    def prompts(self, name: str, requests: list[Request]) -> list:
        """Each request's Prompt under tokenizer `name`."""
        tok = self.get(name)
        try:
            return build_prompts(tok, requests)
        except Exception:  # a template error: find the lines it came from
            failures = []
            for r in requests:
                try:
                    build_prompt(tok, r)
                except Exception as e:  # noqa: BLE001 - a template's own error, whatever its type
                    failures.append((r, str(e)))
            if failures:
                raise RenderError(failures) from None
            raise


def _per_rules(rules: RuleSet, requests: list[Request], prompts: list) -> dict:
    outcomes = simulate(rules, requests, prompts)
    tokens = {"tokenizer": rules.tokenizer, "scaled_to_usage": None}
    factor = usage_scale(requests, outcomes) if rules.scale_to_usage else None
    if factor is not None:
        outcomes = scaled(outcomes, factor, rules)
        tokens["scaled_to_usage"] = round(factor, 6)
    rows = []
    for req, o in zip(requests, outcomes):
        row = {"line": req.line, "arrival_s": req.arrival_s, "prompt_tokens": o.prompt_tokens,
               "common_prefix_tokens": o.common_prefix_tokens, "cache_read_tokens": o.cached_tokens,
               "cache_write_tokens": o.written_tokens, "uncached_tokens": o.uncached_tokens,
               "cached_tokens": o.cached_tokens, "written_tokens": o.written_tokens,
               "output_tokens": o.output_tokens, "parts": o.parts,
               "cost_without": round(o.cost_without, 8), "cost_with": round(o.cost_with, 8)}
        if o.written_long_tokens:
            row["cache_write_long_tokens"] = o.written_long_tokens
        if o.why:
            row["why"] = o.why
        if req.upstream_cached_tokens is not None:
            row["upstream_cached_tokens"] = req.upstream_cached_tokens
        if req.upstream_cache_write_tokens is not None:
            row["upstream_cache_write_tokens"] = req.upstream_cache_write_tokens
        if req.upstream_usage_unread:
            row["upstream_usage_unread"] = req.upstream_usage_unread
        rows.append(row)
    out = {"rules": rules.to_json(), "tokens": tokens, "totals": totals(outcomes), "requests": rows}
    error = upstream_error(rows)
    if error is not None:
        out["error"] = error
    notes = []
    if rules.breakpoints and not any(p.marks for p in prompts):
        notes.append("no request has a cache_control mark: these rules cache nothing without one")
    overflow = sum(1 for o in outcomes if o.parts.get("overflow"))
    if overflow:
        notes.append(f"{overflow} of {len(outcomes)} requests came past ~{rules.overflow_per_minute} a "
                     f"minute on one prefix and key and were routed to another machine with a cold cache: "
                     f"spread them over prompt_cache_key values (per user or per app)")
    if notes:
        out["note"] = "; ".join(notes)
    return out


def upstream_error(rows: list[dict]) -> dict | None:
    """The prediction against the upstream's own cached tokens, over the requests that reported
    them: how many are exact and the mean absolute error in tokens (None: none reported)."""
    pairs = [(r["cached_tokens"], r["upstream_cached_tokens"]) for r in rows if "upstream_cached_tokens" in r]
    unread = [r["upstream_usage_unread"] for r in rows if "upstream_usage_unread" in r]
    if not pairs and not unread:
        return None
    mean = round(sum(abs(p - u) for p, u in pairs) / len(pairs), 3) if pairs else None
    out = {"requests": len(pairs), "exact": sum(1 for p, u in pairs if p == u), "mean_abs_error_tokens": mean}
    if unread:  # answers whose usage the proxy could not read: not compared, and why
        out["unread"] = {"requests": len(unread), "why": unread[0]}
    return out


def _prompts(toks: Tokenizers, names: set[str], requests: list[Request], skipped: list,
             strict: bool) -> tuple[list[Request], dict]:
    """The requests every tokenizer renders and their prompts by tokenizer; a request a template
    cannot render is skipped with why (strict: a ValueError naming its line)."""
    while True:
        try:
            return requests, {name: toks.prompts(name, requests) for name in names}
        except RenderError as e:
            if strict:
                raise ValueError(str(e)) from None
            skipped += [{"line": r.line, "why": f"cannot render the chat messages: {why}"}
                        for r, why in e.failures]
            gone = {id(r) for r, _ in e.failures}
            requests = [r for r in requests if id(r) not in gone]
            if not requests:
                raise ValueError(f"no request could be rendered ({e})") from None


def advise(trace: str, requests: list[Request], rule_sets: list[RuleSet], toks: Tokenizers,
           skipped: list | None = None, strict: bool = True) -> dict:
    """Everything the advisor says about `requests` (arrival order) under `rule_sets`; `skipped`:
    the trace's lines left out, as `read_traffic` reported them (and, unless `strict`, those of
    requests a chat template cannot render)."""
    skipped = [] if skipped is None else skipped
    requests, prompts = _prompts(toks, {"model", *(r.tokenizer for r in rule_sets)}, requests, skipped,
                                 strict)
    results = [_per_rules(r, requests, prompts[r.tokenizer]) for r in rule_sets]
    divergences = find_divergences(requests, prompts["model"])
    groups = group(divergences)
    out = {"schema": SCHEMA, "trace": os.path.abspath(trace) if trace else "",
           "requests": len(requests), "skipped": skipped, "rule_sets": results, "groups": groups,
           "divergences": [{"line": d.line, "matched_line": d.matched_line, "token": d.token,
                            "message": d.message, "role": d.role, "field": d.field, "start": d.start,
                            "end": d.end, "kind": d.kind} for d in divergences if d is not None],
           "what_if": None}
    target = next((g for g in groups if not g["expected"]), None)
    if target is not None:
        fixed = fixed_traffic(requests, target)
        fixed_prompts = {name: toks.prompts(name, fixed) for name in {r.tokenizer for r in rule_sets}}
        after = {r.name: totals(simulate(r, fixed, fixed_prompts[r.tokenizer])) for r in rule_sets}
        out["what_if"] = {"group": target["summary"], "fix": describe(target),
                          "rule_sets": [{"name": res["rules"]["name"], "before": res["totals"],
                                         "after": after[res["rules"]["name"]]} for res in results]}
    return out
