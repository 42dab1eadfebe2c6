"""What a fix buys: the largest divergence group's span moved to the end of the last user message
(reordered JSON or tools written in one canonical order instead), then simulated again.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

from .divergence import CLASSES
from .traffic import Request

_PATTERNS = dict(CLASSES)


def _span(content: str, group: dict) -> tuple[int, int] | None:
    """This request's own span for the group: its value of the group's kind at the group's place."""
    start, end = group["start"], group["end"]
    pattern = _PATTERNS.get(group["kind"])
    if pattern is None:
        return (start, end) if end <= len(content) and start < end else None
    for m in pattern.finditer(content):
        if m.start() <= start < m.end() or m.start() == start:
            return m.start(), m.end()
        if m.start() > start:
            break
    return None


def _move(req: Request, group: dict) -> None:
    msgs = req.messages
    i = group["message"]
    if msgs is None or i is None or i >= len(msgs) or msgs[i].role != group["role"]:
        return
    span = _span(msgs[i].content, group)
    users = [k for k, m in enumerate(msgs) if m.role == "user"]
    if span is None or not users:
        return
    s, e = span
    moved = msgs[i].content[s:e]
    cut = msgs[i].content[:s] + msgs[i].content[e:]
    def shift(ends: list[int]) -> list[int]:
        return [c - (e - s) if c >= e else min(c, s) for c in ends]
    msgs[i] = replace(msgs[i], content=cut, marks=shift(msgs[i].marks), blocks=shift(msgs[i].blocks))
    last = msgs[users[-1]]
    grown = f"{last.content}\n{moved}"
    msgs[users[-1]] = replace(last, content=grown, blocks=last.blocks[:-1] + [len(grown)])


def _canonical(req: Request, group: dict) -> None:
    """Reordered keys or tools: the one order a fix would write them in."""
    if group["field"] == "tools" and req.tools:
        req.tools = sorted(req.tools, key=lambda t: json.dumps(t, sort_keys=True))
        req.tools = [json.loads(json.dumps(t, sort_keys=True)) for t in req.tools]
        return
    i = group["message"]
    msgs = req.messages or []
    if i is not None and i < len(msgs):
        try:
            value = json.loads(msgs[i].content)
        except ValueError:
            return
        text = json.dumps(value, sort_keys=True, ensure_ascii=False)
        msgs[i] = replace(msgs[i], content=text, blocks=[len(text)])


def fixed_traffic(requests: list[Request], group: dict) -> list[Request]:
    """A copy of the traffic with the group's cause fixed in every request that has it."""
    out = copy.deepcopy(requests)
    for req in out:
        if group["kind"] == "reordered":
            _canonical(req, group)
        elif group["field"] == "content":
            _move(req, group)
    return out


def describe(group: dict) -> str:
    """The fix in words."""
    if group["kind"] == "reordered":
        return f"write the {group['field']} in one fixed order (sorted keys and tools)"
    return (f"move {group['label']} from message {group['message']} ({group['role']}), characters "
            f"{group['start']}-{max(group['start'], group['end'] - 1)}, to the end of the last user message")
