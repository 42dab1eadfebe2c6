"""A person's traffic for the advisor: chat-log JSONL or the proxy's recordings (docs/design.md §14).

One request per line: an OpenAI chat body (`messages`, optional `timestamp` in ms and
`usage`), a completions body (`prompt`), or a `prefixlab proxy` record (`body`,
`timestamp`, `usage`, `key`). Lines are read one at a time and capped in size, so a
runaway line is refused by number instead of filling memory.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.chat import MAX_TEMPLATE_CHARS

from ..replay.trace import (
    MAX_LINE_BYTES,  # noqa: F401 - the proxy sizes its records by the reader's limit
    PREFIXLAB_TAG,
    LineError,
    TraceError,
    json_lines,
    open_trace,
)

# The text of one request, at most: a chat template renders no more (and no context holds more)
MAX_REQUEST_CHARS = MAX_TEMPLATE_CHARS


@dataclass
class Message:
    """One chat message as text, with the cache_control marks inside it (character ends)."""

    role: str
    content: str
    marks: list[int] = field(default_factory=list)
    long: list[bool] = field(default_factory=list)   # per mark: its "ttl" asks for the long lifetime ("1h")
    blocks: list[int] = field(default_factory=list)  # character ends of the content's blocks


@dataclass
class Request:
    """One request of the traffic, as the advisor needs it."""

    line: int
    arrival_s: float
    key: str = ""                        # routing key: prompt_cache_key, else the API key's tenant
    messages: list[Message] | None = None
    tools: list | None = None
    tools_marked: bool = False           # a cache_control mark on a tool (Anthropic)
    tools_long: bool = False             # ... whose "ttl" is "1h"
    auto_mark: str | None = None         # a top-level cache_control (Anthropic): "5m" or "1h"
    long_retention: bool = False         # OpenAI's prompt_cache_retention asks for 24 h
    answer_s: float | None = None        # when its answer began (the proxy's first_byte_ms), if recorded
    prompt_text: str | None = None       # completions
    tokens: list[int] | None = None      # a prefixlab token trace's prompt (no text to map back to)
    output_tokens: int = 0
    upstream_cached_tokens: int | None = None
    upstream_prompt_tokens: int | None = None
    upstream_cache_write_tokens: int | None = None  # Anthropic's cache_creation_input_tokens
    upstream_usage_unread: str = ""      # why the proxy could not read the answer's usage, if it could not
    model: str = ""


def reported_usage(obj: dict | None) -> tuple[int | None, int | None]:
    """(prompt tokens, cached tokens) an upstream reported: OpenAI's usage, llama.cpp's timings or
    Anthropic's cache_read_input_tokens; None where it said nothing."""
    if not isinstance(obj, dict):
        return None, None
    usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
    timings = obj.get("timings") if isinstance(obj.get("timings"), dict) else {}
    details = usage.get("prompt_tokens_details")
    details = details if isinstance(details, dict) else {}
    cached = details.get("cached_tokens", usage.get("cache_read_input_tokens", timings.get("cache_n")))
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    if "prompt_tokens" not in usage and isinstance(prompt, int):  # Anthropic: input_tokens is only the
        prompt += sum(v for k in ("cache_read_input_tokens", "cache_creation_input_tokens")  # uncached
                      if isinstance(v := usage.get(k), int) and v >= 0)
    if prompt is None and "prompt_n" in timings and "cache_n" in timings:
        prompt = timings["prompt_n"] + timings["cache_n"]
    def whole(v):
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None
    return whole(prompt), whole(cached)


class _Skips:
    """A read's bad lines, appended to the advice's `skipped` list as {line, why}."""

    def __init__(self, skipped: list):
        self.skipped = skipped

    def add(self, line: int, why: str) -> None:
        self.skipped.append({"line": line, "why": why})


def read_lines(path: str, skipped: list | None = None) -> Iterator[tuple[int, dict]]:
    """(line number, object) per non-blank line, each bounded in size; a bad line is a TraceError
    naming it, or with `skipped` a {line, why} there."""
    skips = None if skipped is None else _Skips(skipped)
    for lineno, obj in json_lines(path, skips):
        if isinstance(obj, dict):
            yield lineno, obj
            continue
        error = LineError(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
        if skips is None:
            raise error
        skips.add(lineno, error.why)


_MEDIA = {"image", "document", "image_url", "input_audio", "file", "search_result", "container_upload"}


def _ttl(mark, where: str) -> bool:
    """Whether a cache_control mark asks for the long lifetime; a TraceError for a ttl it cannot be."""
    ttl = mark.get("ttl", "5m") if isinstance(mark, dict) else "5m"
    if ttl not in ("5m", "1h"):
        raise TraceError(f"{where}: cache_control 'ttl' must be \"5m\" or \"1h\", got {ttl!r}")
    return ttl == "1h"


def _block_text(part: dict) -> str:
    """One content block as the text it stands for in the prompt: its text, a tool call's or tool
    result's content, a media block as a digest of its source (the same image is the same tokens;
    what an image costs in tokens is not modelled)."""
    kind = part.get("type")
    if isinstance(part.get("text"), str):
        return part["text"]
    if kind in ("thinking", "redacted_thinking"):
        return str(part.get("thinking", part.get("data", "")))
    if kind == "tool_result":
        inner = part.get("content")
        return inner if isinstance(inner, str) else _parts(inner, "")[0] if isinstance(inner, list) else ""
    rest = {k: v for k, v in part.items() if k != "cache_control"}
    if kind in _MEDIA:
        digest = hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()[:16]
        return f"[{kind} {digest}]"
    return json.dumps(rest, ensure_ascii=False)  # tool_use and any other block: its JSON


def _parts(content, where: str) -> tuple[str, list[int], list[bool], list[int]]:
    """A message content as text, the character ends of its blocks marked with cache_control
    (and whether each mark asks for the long lifetime), and the character ends of all its blocks."""
    if content is None or isinstance(content, str):
        return content or "", [], [], [len(content or "")]
    if not isinstance(content, list):
        raise TraceError(f"{where}: content must be a string or a list of parts, "
                         f"got {type(content).__name__}")
    text, marks, long, blocks = "", [], [], []
    for part in content:
        if not isinstance(part, dict):
            continue
        text += _block_text(part)
        blocks.append(len(text))
        if part.get("cache_control"):
            marks.append(len(text))
            long.append(_ttl(part["cache_control"], where))
    return text, marks, long, blocks


def _messages(body: dict, where: str) -> list[Message]:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw or not all(isinstance(m, dict) for m in raw):
        raise TraceError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    out = []
    if "system" in body:  # Anthropic's Messages body keeps the system prompt apart
        out.append(Message("system", *_parts(body["system"], f"{where}, system")))
    for i, m in enumerate(raw):
        if not isinstance(m.get("role"), str):
            raise TraceError(f"{where}, message {i}: 'role' must be a string")
        out.append(Message(m["role"], *_parts(m.get("content"), f"{where}, message {i}")))
    return out


def parse_request(obj: dict, path: str, line: int) -> Request:
    """One line as a Request; a TraceError names the line and what is missing."""
    where = f"{path}, line {line}"
    body = obj.get("body") if isinstance(obj.get("body"), dict) else obj
    stamp = obj.get("timestamp")
    if stamp is not None and (isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or
                              not math.isfinite(stamp) or stamp < 0):
        raise TraceError(f"{where}: 'timestamp' must be milliseconds >= 0 and finite, got {stamp!r}")
    prompt_tokens, cached = reported_usage(obj)
    if cached is None and isinstance(obj.get("response"), dict):
        prompt_tokens, cached = reported_usage(obj["response"])
    usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
    out = usage.get("completion_tokens", usage.get("output_tokens", 0))
    key = body.get("prompt_cache_key") or obj.get("key") or ""
    r = Request(line=line, arrival_s=stamp / 1000.0 if stamp is not None else float(line - 1),
                key=str(key), output_tokens=out if isinstance(out, int) and out > 0 else 0,
                upstream_cached_tokens=cached, upstream_prompt_tokens=prompt_tokens,
                model=str(body.get("model") or ""))
    began = obj.get("first_byte_ms")
    if isinstance(began, (int, float)) and not isinstance(began, bool) and 0 <= began < float("inf"):
        r.answer_s = r.arrival_s + began / 1000.0
    unread = obj.get("usage_unread")
    if isinstance(unread, str):
        r.upstream_usage_unread = unread[:200]
    wrote = usage.get("cache_creation_input_tokens")
    if isinstance(wrote, int) and not isinstance(wrote, bool) and wrote >= 0:
        r.upstream_cache_write_tokens = wrote
    if "hash_ids" in obj:
        raise TraceError(f"{where}: a Mooncake hash-id trace has block hashes, not prompts: the advisor "
                         f"needs prompts (chat logs, proxy recordings or token traces)")
    if "messages" in body:
        r.messages = _messages(body, where)
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise TraceError(f"{where}: 'tools' must be a list")
        r.tools = tools or None
        marked = [t["cache_control"] for t in tools or [] if isinstance(t, dict) and t.get("cache_control")]
        r.tools_marked = bool(marked)
        r.tools_long = any(_ttl(m, f"{where}, tools") for m in marked)
        if body.get("cache_control"):  # automatic caching: a mark on the last cacheable block
            r.auto_mark = "1h" if _ttl(body["cache_control"], where) else "5m"
        r.long_retention = body.get("prompt_cache_retention") == "24h"
    elif isinstance(body.get("prompt"), str):
        r.prompt_text = body["prompt"]
    elif _token_ids(body.get("prompt")):
        r.tokens = body["prompt"]  # a completion given token ids (or the app's served prompts)
    else:
        raise TraceError(f"{where}: no 'messages' (a chat request) and no 'prompt' (a completion: a text "
                         f"or token ids)")
    chars = _chars(r)
    if chars > MAX_REQUEST_CHARS:
        raise TraceError(f"{where}: the request's text is {chars:,} characters, over the advisor's limit of "
                         f"{MAX_REQUEST_CHARS:,} (what a chat template renders)")
    return r


def _chars(r: Request) -> int:
    """Characters of a request's text (token ids count one each)."""
    if r.messages is not None:
        return sum(len(m.content) for m in r.messages)
    return len(r.prompt_text) if r.prompt_text is not None else len(r.tokens or ())


def _token_trace(path: str, skipped: list, strict: bool) -> list[Request]:
    """A prefixlab trace (a session's, or `replay --record`'s): prompts as token ids."""
    source = open_trace(path, "prefixlab", strict=strict)
    if source.hashed:
        raise TraceError(f"{path}: a hash-id trace has block hashes, not tokens: the advisor needs "
                         f"prompts (chat logs, proxy recordings or token traces)")
    out = [Request(line=i + 2, arrival_s=r.arrival_s, key=r.namespace, tokens=r.prompt,
                   output_tokens=r.output_length) for i, r in enumerate(source)]
    skipped += source.skipped.examples
    if source.skipped.count > len(source.skipped.examples):
        skipped.append({"line": None, "why": f"and {source.skipped.count - len(source.skipped.examples):,} "
                                             f"more bad lines"})
    return out


def unusable(obj: dict) -> str:
    """Why a proxy record cannot join the traffic ("" when it can): no body kept, or refused."""
    if "endpoint" not in obj:
        return ""  # a chat log's line: always used
    if not isinstance(obj.get("body"), dict):
        return obj.get("body_omitted") or obj.get("body_error") or "no request body recorded"
    status = obj.get("status", 200)
    if isinstance(status, int) and status >= 400:
        return f"the upstream answered {status}"
    body = obj["body"]
    prompt = body.get("prompt")
    if "messages" not in body and not isinstance(prompt, str) and not _token_ids(prompt):
        return "a completion whose prompt is neither one text nor token ids (a batch of prompts?)"
    return ""


def _token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def read_traffic(path: str, skipped: list | None = None, strict: bool = True) -> list[Request]:
    """Every request of a trace, in arrival order (ties: file order); proxy records that cannot
    count (refused, or kept without a body) go to `skipped` as {line, why} instead, and so do bad
    lines unless `strict` (then the first one is a TraceError naming it)."""
    skipped = [] if skipped is None else skipped
    bad: list = []  # lines that are not requests at all
    lines = read_lines(path, None if strict else bad)
    first = next(lines, None)
    if first is not None and first[1].get("format") == PREFIXLAB_TAG:
        lines.close()
        requests = _token_trace(path, bad, strict)
    else:
        requests = []
        for line, obj in itertools.chain([first] if first else [], lines):
            why = unusable(obj)
            if why:
                skipped.append({"line": line, "why": why})
                continue
            try:
                requests.append(parse_request(obj, path, line))
            except TraceError as e:
                if strict:
                    raise
                bad.append({"line": line, "why": str(e).removeprefix(f"{path}, line {line}").lstrip(":, ")})
    if not requests:
        what = "proxy records" if not bad else "lines"
        left = f" ({len(skipped) + len(bad)} {what} skipped: {(skipped + bad)[0]['why']}, ...)" \
            if skipped or bad else ""
        raise TraceError(f"{path}: the trace has no requests{left}")
    skipped += bad
    skipped.sort(key=lambda k: math.inf if k["line"] is None else k["line"])
    requests.sort(key=lambda r: (r.arrival_s, r.line))
    return requests
