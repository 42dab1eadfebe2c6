"""The advice as one self-contained HTML page (`prefixlab advise --report`), no Qt needed."""

from __future__ import annotations

from html import escape
from urllib.parse import urlsplit

_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:70em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.3em .6em;text-align:right}
th:first-child,td:first-child{text-align:left}mark{background:#ffd54f;padding:0 .1em}
code{background:#f4f4f4;padding:.1em .3em;white-space:pre-wrap}.note{color:#666;font-size:90%}"""


def money(v: float) -> str:
    """USD with enough digits for small traces."""
    return f"${v:,.4f}" if abs(v) < 100 else f"${v:,.2f}"


def totals_rows(advice: dict) -> list[list[str]]:
    """One row per rule set: name, as of, requests, prompt, cached, hit ratio, cost without, with, saved."""
    rows = []
    for rs in advice["rule_sets"]:
        t, r = rs["totals"], rs["rules"]
        rows.append([r["name"], r["as_of"], f"{t['requests']:,}", f"{t['prompt_tokens']:,}",
                     f"{t['cached_tokens']:,}", f"{t['token_hit_ratio']:.1%}", money(t["cost_without"]),
                     money(t["cost_with"]), money(t["saved"])])
    return rows


TOTALS_HEAD = ["rules", "as of", "requests", "prompt tokens", "cached tokens", "hit ratio",
               "cost without cache", "cost with cache", "saved"]
WHATIF_HEAD = ["rules", "hit ratio before", "hit ratio after", "cost before", "cost after"]


def whatif_rows(advice: dict) -> list[list[str]]:
    """One row per rule set: hit ratio and cost before and after the fix."""
    w = advice.get("what_if") or {"rule_sets": []}
    return [[r["name"], f"{r['before']['token_hit_ratio']:.1%}", f"{r['after']['token_hit_ratio']:.1%}",
             money(r["before"]["cost_with"]), money(r["after"]["cost_with"])] for r in w["rule_sets"]]


def error_text(rs: dict) -> str:
    """The prediction against the upstream's own cached tokens, in words ("" when none reported)."""
    e = rs.get("error")
    if not e:
        return ""
    text = (f"{e['exact']:,} of {e['requests']:,} requests exact, mean error "
            f"{e['mean_abs_error_tokens']:,.1f} tokens") if e["requests"] else ""
    if e.get("unread"):
        gone = f"{e['unread']['requests']:,} answers' usage unread ({e['unread']['why']})"
        text = f"{text}; {gone}" if text else gone
    return text


def tokens_text(rs: dict) -> str:
    """Which tokens the counts are in ("" for an older advice that did not say)."""
    t = rs.get("tokens")
    if not t:
        return ""
    name = "the loaded model's tokenizer" if t["tokenizer"] == "model" else t["tokenizer"]
    scale = t.get("scaled_to_usage")
    if scale:
        return f"tokens: {name}, scaled x{scale:.3f} to the recording's usage.prompt_tokens"
    if rs["rules"].get("scale_to_usage"):
        return f"tokens: {name} (no public tokenizer, and no recorded usage to scale to)"
    return f"tokens: {name}"


def provider_notes(rs: dict) -> list[str]:
    """The lines a rule set's advice carries beside its totals: its note, tokens, the prediction's
    error against the upstream, and what it does not model (an older advice has fewer)."""
    lines = [rs["note"]] if rs.get("note") else []
    lines += [x for x in (tokens_text(rs), error_text(rs) and f"against the upstream: {error_text(rs)}") if x]
    unmodelled = rs["rules"].get("unmodelled") or []
    if unmodelled:
        lines.append("not modelled: " + "; ".join(unmodelled))
    return lines


def error_rows(advice: dict, limit: int = 200) -> list[list[str]]:
    """Per request where the upstream reported its cached tokens: rule set, line, predicted, upstream."""
    rows = []
    for rs in advice["rule_sets"]:
        got = [r for r in rs.get("requests", []) if "upstream_cached_tokens" in r][:limit]
        for r in got:
            ours, theirs = r["cached_tokens"], r["upstream_cached_tokens"]
            rows.append([rs["rules"]["name"], str(r["line"]), f"{ours:,}", f"{theirs:,}",
                         f"{ours - theirs:+,}"])
    return rows


ERROR_HEAD = ["rules", "line", "predicted cached", "upstream cached", "difference"]


def view_data(advice: dict) -> dict:
    """The advice as plain rows for a view (the Advisor tab, the session report's section)."""
    tips = ["\n".join([f"{rs['rules']['name']}: as of {rs['rules']['as_of']}, {rs['rules']['source']}",
                       *provider_notes(rs)]) for rs in advice["rule_sets"]]
    groups = [{"summary": g["summary"], "before": g["example"]["before"], "text": g["example"]["text"]}
              for g in advice["groups"]]
    w = advice.get("what_if")
    head, rows = TOTALS_HEAD, totals_rows(advice)
    if any(rs.get("error") for rs in advice["rule_sets"]):  # measured: the error beside each prediction
        head = [*head, "against the upstream"]
        rows = [[*row, error_text(rs) or "-"] for row, rs in zip(rows, advice["rule_sets"])]
    return {"totals_head": head, "totals_rows": rows, "tips": tips, "groups": groups,
            "fix": w["fix"] if w else None, "whatif_head": WHATIF_HEAD, "whatif_rows": whatif_rows(advice),
            "trace": advice.get("trace", ""), "requests": advice.get("requests", 0)}


def link(url: str) -> str:
    """`url` as a link if it is a web address (http or https), else as plain text: a rules file's
    `source = "javascript:..."` must not become something a click runs."""
    if urlsplit(url.strip()).scheme.lower() in ("http", "https"):
        return f"<a href='{escape(url.strip())}'>{escape(url)}</a>"
    return escape(url)


def _table(head: list[str], rows: list[list[str]]) -> str:
    cells = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{cells}</tr>{body}</table>"


def render_html(advice: dict) -> str:
    """The whole page: totals per rule set, the divergence groups (the differing text marked), the what-if."""
    parts = ["<!doctype html><meta charset='utf-8'><title>Prompt-caching advice</title>",
             f"<style>{_STYLE}</style><h1>Prompt-caching advice</h1>",
             f"<p>{escape(advice['trace'])}: {advice['requests']:,} requests"
             + (f" ({len(advice['skipped']):,} lines skipped, e.g. line {advice['skipped'][0]['line']}: "
                f"{escape(advice['skipped'][0]['why'])})" if advice.get("skipped") else "") + "</p>",
             "<h2>Per provider</h2>", _table(TOTALS_HEAD, totals_rows(advice))]
    parts.append("<p class='note'>" + "<br>".join(
        f"{escape(rs['rules']['name'])}: as of {escape(rs['rules']['as_of'])}, "
        f"{link(rs['rules']['source'])}"
        + (f" ({escape(rs['note'])})" if rs.get("note") else "")
        for rs in advice["rule_sets"]) + "</p>")
    notes = [(rs["rules"]["name"], line) for rs in advice["rule_sets"] for line in provider_notes(rs)
             if line != rs.get("note")]
    if notes:
        parts.append("<ul class='note'>" + "".join(f"<li>{escape(n)}: {escape(line)}</li>"
                                                   for n, line in notes) + "</ul>")
    measured = error_rows(advice)
    if measured:
        parts += ["<h2>Prediction against the upstream's cached tokens</h2>", _table(ERROR_HEAD, measured)]
    parts.append("<h2>Where prompts diverge</h2>")
    if not advice["groups"]:
        parts.append("<p>No request departs from an earlier one: each extends or repeats another.</p>")
    for g in advice["groups"][:10]:
        ex = g["example"]
        parts.append(f"<p><b>{escape(g['summary'])}</b><br><code>…{escape(ex['before'])}"
                     f"<mark>{escape(ex['text'])}</mark>…</code> (the request it departs from has "
                     f"<code>{escape(ex['other'])}</code>)</p>")
    w = advice.get("what_if")
    if w:
        parts += ["<h2>What a fix buys</h2>", f"<p>{escape(w['fix'][0].upper() + w['fix'][1:])}:</p>",
                  _table(WHATIF_HEAD, whatif_rows(advice))]
    return "".join(parts) + "\n"
