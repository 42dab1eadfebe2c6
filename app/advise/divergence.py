"""Where prompts diverge, in words: the first differing token of each request against its best
earlier match, mapped to a message, a field and a character span, classified and grouped
(docs/design.md §14).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass

from .prompts import Prompt
from .traffic import Request
from .trie import PromptTrie

_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.?"
_DAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*,?\s"
TIMESTAMP = re.compile(
    r"\d{4}-\d{2}-\d{2}(?:[T ]\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:\s?(?:Z|UTC|[+-]\d{2}:?\d{2}))?)?"
    rf"|(?:{_DAY})?\d{{1,2}}\s{_MONTH}\s\d{{4}}(?:,?\s\d{{1,2}}:\d{{2}}(?::\d{{2}})?)?"
    rf"|(?:{_DAY})?{_MONTH}\s\d{{1,2}}(?:st|nd|rd|th)?,?\s\d{{4}}(?:,?\s\d{{1,2}}:\d{{2}}(?::\d{{2}})?)?"
    r"|\d{1,2}/\d{1,2}/\d{2,4}(?:,?\s\d{1,2}:\d{2}(?::\d{2})?)?"
    r"|\b\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:\s?[AaPp][Mm])?"
    r"|\b1\d{9}(?:\d{3})?\b")
HEX_ID = re.compile(
    r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
    r"|\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,}\b")
NUMBER = re.compile(r"[-+]?\d+(?:[.,]\d+)*")
CLASSES = (("timestamp", TIMESTAMP), ("id", HEX_ID), ("number", NUMBER))
LABELS = {"timestamp": "a timestamp or date", "id": "a UUID or hex id", "number": "a number",
          "whitespace": "whitespace", "reordered": "reordered keys or tools", "other": "other text"}
CONTEXT_CHARS = 40
MAX_OTHER = 80  # an "other text" span ends at its line's end or after this many characters


@dataclass
class Divergence:
    """Where one request left its best earlier match."""

    line: int
    matched_line: int
    token: int
    message: int | None
    role: str
    field: str
    start: int
    end: int
    kind: str
    text: str        # this request's text in the span
    other: str       # the matched request's text there
    before: str      # shared text just before the span
    last_message: bool = False  # in the request's last message (its new question)

    @property
    def where(self) -> tuple:
        return (self.message, self.role, self.field, self.start, self.end, self.kind)


def field_text(req: Request, message: int | None, fld: str) -> str:
    """The text of one field of a chat request (a message's content, or the tools' JSON)."""
    if fld == "tools":
        return json.dumps(req.tools or [], ensure_ascii=False)
    msgs = req.messages or []
    return msgs[message].content if message is not None and message < len(msgs) else ""


def _common(a: str, b: str) -> tuple[int, int]:
    """Lengths of the common prefix and of the common suffix after it (slices compare in C)."""
    n = min(len(a), len(b))
    lo, hi = 0, n
    while lo < hi:  # the longest k with a[:k] == b[:k]
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid - 1)
    p = lo
    lo, hi = 0, n - p
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if a[len(a) - mid:] == b[len(b) - mid:] else (lo, mid - 1)
    return p, lo


def _reordered(a: str, b: str) -> bool:
    """Both texts are the same JSON value written in another order (keys, or list items)."""
    try:
        x, y = json.loads(a), json.loads(b)
    except ValueError:
        return False
    if x == y:
        return True
    if isinstance(x, list) and isinstance(y, list):
        def canon(items):
            return sorted(json.dumps(v, sort_keys=True) for v in items)
        return canon(x) == canon(y)
    return False


def classify(a: str, b: str) -> tuple[str, int, int]:
    """(kind, start, end) of where text `a` departs from `b`, the span widened to the whole value."""
    if a == b:  # the field is the same: what differs is around it (the template's structure)
        return "other", 0, 0
    p, s = _common(a, b)
    end = len(a) - s
    if _reordered(a, b):
        return "reordered", 0, len(a)  # the whole value: its order, not a part, differs
    if not a[p:end].strip() and not b[p:len(b) - s].strip():
        return "whitespace", p, end
    for kind, pattern in CLASSES:  # the value the difference starts in (the rest may differ too)
        for m in pattern.finditer(a):
            if m.start() <= p < m.end() or (m.start() <= p == m.end() and end == p):
                return kind, m.start(), m.end()
            if m.start() > p:
                break
    line_end = a.find("\n", p)
    return "other", p, min(end, p + MAX_OTHER, line_end if line_end >= p else len(a))


def _counterpart(b: str, kind: str, start: int, aligned_end: int) -> str:
    """What the matched request has at the span: its own value of the kind, else the text up to
    the shared tail."""
    pattern = dict(CLASSES).get(kind)
    for m in pattern.finditer(b) if pattern else ():
        if m.start() <= start < m.end():
            return m.group()
        if m.start() > start:
            break
    return b[start:aligned_end][:MAX_OTHER]


def find_divergences(requests: list[Request], prompts: list[Prompt]) -> list[Divergence | None]:
    """Per request (arrival order): where it departs from the earlier request sharing the most tokens
    with it (same routing key, any age); None for a first request or one that only extends it."""
    tries: dict[str, PromptTrie] = {}
    out: list[Divergence | None] = []
    for i, (req, prompt) in enumerate(zip(requests, prompts)):
        trie = tries.setdefault(req.key, PromptTrie())
        longest, j = trie.match(prompt.tokens, req.arrival_s, float("inf"))
        trie.add(i, prompt.tokens, req.arrival_s)
        if j < 0 or longest >= len(prompt.tokens) or longest >= len(prompts[j].tokens):
            out.append(None)
            continue
        seg, _ = prompt.where(longest)
        oseg, _ = prompts[j].where(longest)
        msg, fld = (seg.message, seg.field) if seg else (None, "prompt")
        same_field = oseg is not None and (oseg.message, oseg.field) == (msg, fld)
        if fld == "prompt":  # a completion's or a token trace's prompt: the text the tokens make
            a, b = prompt.text, prompts[j].text
        elif same_field and seg.role != oseg.role:  # the same place, another speaker
            fld, a, b = "role", seg.role, oseg.role
        else:
            a = field_text(req, msg, fld)
            b = field_text(requests[j], msg, fld) if same_field else ""
        kind, start, end = classify(a, b)
        other = _counterpart(b, kind, start, max(start, len(b) - (len(a) - end)))
        out.append(Divergence(req.line, requests[j].line, longest, msg, seg.role if seg else "", fld,
                              start, end, kind, a[start:end], other, a[max(0, start - CONTEXT_CHARS):start],
                              msg is not None and msg == len(req.messages or []) - 1))
    return out


def group(divergences: list[Divergence | None]) -> list[dict]:
    """Divergences grouped by where they happen, each with a sentence: largest first, those in a
    request's own last message (its new question, expected) after the rest."""
    total = len(divergences)
    groups: dict[tuple, list[Divergence]] = defaultdict(list)
    for d in divergences:
        if d is not None:
            groups[d.where].append(d)
    out = []
    ranked = sorted(groups.items(), key=lambda kv: (all(d.last_message for d in kv[1]), -len(kv[1])))
    for (msg, role, fld, start, end, kind), members in ranked:
        ex = members[-1]
        place = f"message {msg} ({role})" if msg is not None else f"the {fld}"
        # a difference in the request's last message is its new question: expected, not a fault
        expected = all(d.last_message for d in members)
        span = f"characters {start}-{max(start, end - 1)}"
        out.append({"message": msg, "role": role, "field": fld, "start": start, "end": end, "kind": kind,
                    "label": LABELS[kind], "count": len(members), "lines": [d.line for d in members],
                    "expected": expected,
                    "example": {"text": ex.text, "other": ex.other, "before": ex.before},
                    "summary": f"{len(members)} of {total} requests diverge in {place} at {span}: "
                               f"{LABELS[kind]}" + (" (their last message: expected)" if expected else "")})
    return out
