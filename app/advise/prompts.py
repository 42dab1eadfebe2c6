"""A request as the tokens a provider caches, with every token traced back to its message.

The prompt is the chat template's text (tools first, as their JSON, since hosted APIs put
tools ahead of the messages in the cached prefix), tokenized with character offsets, so
a token position maps back to (message index, role, field, character).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field

from .traffic import Request

TOOLS_HEAD = "Tools: "


@dataclass
class Segment:
    """Where one field of one message sits in the prompt's text."""

    start: int
    end: int
    message: int | None   # None: the tools, or a completion's prompt
    role: str
    field: str            # "content", "tools" or "prompt"


@dataclass
class Prompt:
    """A request's prompt: tokens, their character offsets, and the fields they came from."""

    text: str
    tokens: list[int]
    starts: list[int]                    # character where each token starts
    segments: list[Segment] = field(default_factory=list)
    marks: list[int] = field(default_factory=list)  # token counts ending at a cache_control mark
    long: list[bool] = field(default_factory=list)  # per mark: it asks for the long lifetime ("ttl": "1h")
    blocks: list[int] = field(default_factory=list)  # token counts ending at a content block (tools,
    #                                                  each block of each message)

    def where(self, token: int) -> tuple[Segment | None, int]:
        """The segment holding token `token` and the character inside that field (template text
        between fields maps to the next field, at character 0)."""
        char = self.starts[token] if token < len(self.starts) else len(self.text)
        for seg in self.segments:
            if seg.start <= char < seg.end:
                return seg, char - seg.start
            if char < seg.start:
                return seg, 0
        return (self.segments[-1], self.segments[-1].end - self.segments[-1].start) if self.segments \
            else (None, 0)

    def tokens_before(self, char: int) -> int:
        """How many tokens start before character `char` (a mark's prefix length in tokens)."""
        return bisect.bisect_left(self.starts, char)


def tools_text(tools: list) -> str:
    """The tools as the prompt carries them: their JSON, keys in the order the request gave."""
    return TOOLS_HEAD + json.dumps(tools, ensure_ascii=False) + "\n"


BATCH = 256  # texts per encode_batch call (the tokenizer's threads share the work)


def build_prompt(tok, req: Request) -> Prompt:
    """`req`'s prompt under `tok` (a TextTokenizer): the chat template, or a completion's text."""
    return build_prompts(tok, [req])[0]


def build_prompts(tok, requests: list[Request]) -> list[Prompt]:
    """Every request's prompt under `tok`, the texts tokenized in batches."""
    laid = [_layout(tok, r) for r in requests]
    todo = [k for k, (prompt, _) in enumerate(laid) if not prompt.tokens]
    for at in range(0, len(todo), BATCH):
        chunk = todo[at:at + BATCH]
        encs = tok.tokenizer.encode_batch([laid[k][0].text for k in chunk], add_special_tokens=False)
        for k, enc in zip(chunk, encs):
            prompt, (marks, blocks) = laid[k]
            prompt.tokens, prompt.starts = list(enc.ids), [s for s, _ in enc.offsets]
            if requests[k].messages is None:  # a completion starts with the BOS the model wants
                prefix = tok.prompt_prefix_ids
                if prompt.tokens[:len(prefix)] != prefix:
                    prompt.tokens, prompt.starts = prefix + prompt.tokens, [0] * len(prefix) + prompt.starts
            long: dict[int, bool] = {}
            for c, is_long in marks:
                at = prompt.tokens_before(c)
                long[at] = long.get(at, False) or is_long
            prompt.marks = sorted(long)
            prompt.long = [long[m] for m in prompt.marks]
            prompt.blocks = sorted({prompt.tokens_before(c) for c in blocks})
    return [prompt for prompt, _ in laid]


def _layout(tok, req: Request) -> tuple[Prompt, tuple[list, list[int]]]:
    """The prompt's text and fields (tokens still to come, unless the trace gave them), the
    characters where its cache_control marks end (each with whether it asks for the long
    lifetime) and the characters where its content blocks end."""
    if req.tokens is not None:  # token ids only: the text is their decoding, piece by piece
        pieces = [tok.decode([t]) for t in req.tokens]
        starts = [0] * len(pieces)
        for k in range(1, len(pieces)):
            starts[k] = starts[k - 1] + len(pieces[k - 1])
        text = "".join(pieces)
        return Prompt(text, list(req.tokens), starts, [Segment(0, len(text), None, "", "prompt")]), ([], [])
    if req.messages is None:
        text = req.prompt_text or ""
        return Prompt(text, [], [], [Segment(0, len(text), None, "", "prompt")]), ([], [])
    head = tools_text(req.tools) if req.tools else ""
    rendered = tok.render_chat([{"role": m.role, "content": m.content} for m in req.messages],
                               add_generation_prompt=True)
    text = head + rendered
    segments, marks, blocks = [], [], []
    if head:
        segments.append(Segment(len(TOOLS_HEAD), len(head) - 1, None, "tools", "tools"))
        blocks.append(len(head) - 1)
        if req.tools_marked:
            marks.append((len(head) - 1, req.tools_long))
    cursor = len(head)
    for i, m in enumerate(req.messages):
        at = text.find(m.content, cursor) if m.content else -1
        if at < 0:
            continue  # a template that rewrites the content: its tokens map to the next field found
        segments.append(Segment(at, at + len(m.content), i, m.role, "content"))
        marks += [(at + c, k < len(m.long) and m.long[k]) for k, c in enumerate(m.marks)]
        blocks += [at + c for c in m.blocks]
        cursor = at + len(m.content)
    if req.auto_mark and blocks:  # a top-level cache_control: a mark on the last cacheable block
        marks.append((blocks[-1], req.auto_mark == "1h"))
    return Prompt(text, [], [], segments), (marks, blocks)
