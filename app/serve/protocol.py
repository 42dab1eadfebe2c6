"""OpenAI request parsing and response objects (docs/design.md §8): plain data, no HTTP.

Parsing checks every field a client may send and raises `ApiError` naming the
field; unknown fields are ignored (clients send many), unsupported ones that
would change the answer (`n` > 1, `tools`, `response_format`) are refused.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from engine import SamplingParams
from engine.sampler import REPEAT_PENALTY_RANGE
from engine.token_parts import Account, TokenParts

MAX_STOPS = 4
# The answer limit of a request that sets none: None is OpenAI's (the context). The default
# unbounded pool grows page by page as an answer does; a bounded pool reserves every page a
# request may fill at admission, so a server on one may want a smaller default.
DEFAULT_MAX_TOKENS: int | None = None
MAX_LABEL_CHARS = 64  # a client label (`user`) is kept per client: a 2 MB one must not be
# A salt names a namespace that every cached page of it carries, and a stop string is matched
# against every piece: both refused past these lengths rather than kept or scanned
MAX_SALT_CHARS = 256
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 1024  # biased tokens per request (each is applied to every sampled position)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: -100 bans a token, 100 all but forces it
MAX_SEED = 2**64 - 1
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ApiError(Exception):
    """An error the client gets as an OpenAI error object with this HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
             500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        """The OpenAI error object."""
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """`{"error": {message, type, param, code}}` as OpenAI writes it."""
    return {"error": {"message": message, "type": ApiError.TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


@dataclass
class ParsedRequest:
    """A checked completion request: what to run and how to answer."""

    chat: bool
    messages: list[dict] | None = None
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    model: str = ""
    user: str = ""
    cache_salt: str = ""
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param, "invalid_value")


def check_text(value: str, param: str) -> str:
    """`value` if it is encodable text; a 400 naming `param` for an unpaired surrogate (JSON's
    "\\ud800" decodes to one, and no tokenizer or UTF-8 writer can take it)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(f"'{param}' holds an unpaired surrogate (\\u{ord(value[e.start]):04x} at character "
                   f"{e.start}): not valid Unicode text", param) from None
    return value


def _typed(body: dict, name: str, types, what: str, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int to Python, never a number to a JSON schema
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise _bad(f"'{name}' must be {what}, got {value!r}", name)
    if not isinstance(value, types):
        raise _bad(f"'{name}' must be {what}, got {type(value).__name__} {value!r:.60}", name)
    return check_text(value, name) if isinstance(value, str) else value


def _number(body: dict, name: str, low: float, high: float, default: float, low_open: bool = False) -> float:
    value = float(_typed(body, name, (int, float), "a number", default))
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise _bad(f"'{name}' must be in {bracket}{low:g}, {high:g}], got {value:g}", name)
    return value


def _refuse_unsupported(body: dict) -> None:
    n = _typed(body, "n", int, "an integer", 1)
    if n != 1:
        raise ApiError(400, f"'n' must be 1 (this server returns one choice per request), got {n}", "n",
                       "unsupported_value")
    for name in ("tools", "functions"):
        if body.get(name):
            raise ApiError(400, f"'{name}' is not supported by this server (no tool calling)", name,
                           "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise ApiError(400, "'response_format' is not supported by this server (plain text only)",
                       "response_format", "unsupported_parameter")
    if body.get("logprobs") not in (None, False, 0):
        raise ApiError(400, "'logprobs' is not supported by this server", "logprobs", "unsupported_parameter")


def _common(body: dict, chat: bool) -> ParsedRequest:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}", None)
    _refuse_unsupported(body)
    req = ParsedRequest(chat=chat)
    req.model = _typed(body, "model", str, "a string", "")
    req.user = _typed(body, "user", str, "a string", "")[:MAX_LABEL_CHARS]
    req.cache_salt = _typed(body, "cache_salt", str, "a string", "")
    if len(req.cache_salt) > MAX_SALT_CHARS:
        raise _bad(f"'cache_salt' is {len(req.cache_salt)} characters, at most {MAX_SALT_CHARS}",
                   "cache_salt")
    req.ignore_eos = _typed(body, "ignore_eos", bool, "true or false", False)  # vLLM's extension
    req.stream = _typed(body, "stream", bool, "true or false", False)
    options = _typed(body, "stream_options", dict, "an object", {})
    req.include_usage = _typed(options, "include_usage", bool, "true or false", False)
    temperature = _number(body, "temperature", 0.0, 2.0, 1.0)
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0, low_open=True)
    seed = _typed(body, "seed", int, "an integer", None)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise _bad(f"'seed' must be an integer from 0 to 2^64-1 (omit it for a random seed), got {seed}",
                   "seed")
    # llama.cpp's extensions; OpenAI's own semantics (no top-k, no min-p) unless a client asks
    top_k = _typed(body, "top_k", int, "an integer", 0)
    min_p = _number(body, "min_p", 0.0, 1.0, 0.0)
    repeat_penalty = _number(body, "repeat_penalty", REPEAT_PENALTY_RANGE[0], 10.0, 1.0)
    if top_k < 0:
        raise _bad(f"'top_k' must be >= 0, got {top_k}", "top_k")
    if min_p >= 1.0:
        raise _bad("'min_p' must be below 1", "min_p")
    req.logit_bias = _logit_bias(body)
    req.sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                  repeat_penalty=repeat_penalty, seed=seed, logit_bias=req.logit_bias or None)
    try:
        req.sampling.validate()  # the engine's own ranges: values that would make probabilities NaN
    except ValueError as e:
        raise _bad(str(e), None) from None
    for name in ("max_completion_tokens", "max_tokens"):
        value = _typed(body, name, int, "an integer", None)
        if value is not None:
            if value < 1:
                raise _bad(f"'{name}' must be at least 1, got {value}", name)
            req.max_tokens = value if req.max_tokens is None else req.max_tokens
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and stop != []:  # null and [] both mean no stop string
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise _bad("'stop' must be a non-empty string or a list of non-empty strings", "stop")
        if len(stop) > MAX_STOPS:
            raise _bad(f"'stop' takes at most {MAX_STOPS} strings, got {len(stop)}", "stop")
        if max(map(len, stop)) > MAX_STOP_CHARS:
            raise _bad(f"a 'stop' string is at most {MAX_STOP_CHARS} characters", "stop")
        req.stop = [check_text(s, f"stop[{i}]") for i, s in enumerate(stop)]
    return req


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's `logit_bias`: {"token id": bias in [-100, 100]}; ids are checked against the
    model's vocabulary by `check_logit_bias` once the model is known."""
    raw = _typed(body, "logit_bias", dict, "an object of token id -> bias", {})
    if len(raw) > MAX_LOGIT_BIAS:
        raise _bad(f"'logit_bias' biases at most {MAX_LOGIT_BIAS} tokens, got {len(raw)}", "logit_bias")
    low, high = LOGIT_BIAS_RANGE
    out = {}
    for key, bias in raw.items():
        token = key.strip() if isinstance(key, str) else ""
        if not (token.isdigit() and token.isascii()):
            raise _bad(f"'logit_bias' keys must be token ids (non-negative integers), got {key[:40]!r}",
                       "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not low <= bias <= high:
            raise _bad(f"'logit_bias' values must be numbers from {low:g} to {high:g}, got {bias!r:.40} "
                       f"for token {token}", "logit_bias")
        out[int(token)] = float(bias)
    return out


def check_logit_bias(req: ParsedRequest, vocab_size: int) -> None:
    """A 400 naming `logit_bias`, the id and the vocabulary's size for a token the model has not."""
    bad = [t for t in req.logit_bias if t >= vocab_size]
    if bad:
        raise _bad(f"'logit_bias' names token {min(bad)}, but the model's vocabulary has {vocab_size} tokens "
                   f"(ids 0 to {vocab_size - 1})", "logit_bias")


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return check_text(content, f"messages[{i}].content")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
            if not isinstance(text, str):
                raise _bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            texts.append(check_text(text, f"messages[{i}].content[{len(texts)}].text"))
        return "".join(texts)
    if content is None and message.get("role") == "assistant":
        return ""
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def parse_chat(body) -> ParsedRequest:
    """Check a /v1/chat/completions body."""
    req = _common(body, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object with 'role' and 'content'", f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}",
                       f"messages[{i}].role")
        if m.get("tool_calls"):
            raise ApiError(400, "tool calls are not supported by this server", f"messages[{i}].tool_calls",
                           "unsupported_parameter")
        out.append({"role": ROLES[role], "content": _content(m, i)})
    if out[-1]["role"] == "assistant":
        raise _bad("the last message must not be the assistant's (nothing to answer)", "messages")
    req.messages = out
    return req


def parse_completion(body) -> ParsedRequest:
    """Check a /v1/completions body: `prompt` is a string, a list of token ids, or a list of one of those."""
    req = _common(body, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        req.prompt_text = check_text(prompt, "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in prompt):
        req.prompt_ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "'prompt' with several prompts is not supported: send one per request",
                       "prompt", "unsupported_value")
    else:
        raise _bad("'prompt' must be a non-empty string or a list of token ids", "prompt")
    if body.get("echo"):
        raise ApiError(400, "'echo' is not supported by this server", "echo", "unsupported_parameter")
    if body.get("suffix"):
        raise ApiError(400, "'suffix' is not supported by this server", "suffix", "unsupported_parameter")
    return req


# responses ------------------------------------------------------------------
def new_id(chat: bool) -> str:
    """A fresh completion id, `chatcmpl-…` or `cmpl-…`."""
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(record, diverged_from: str | None) -> dict:
    """OpenAI's usage with cached tokens, from a finished RequestRecord, plus `prefixlab`: where
    its prompt tokens went (docs/design.md §15)."""
    return {"prompt_tokens": record.n_prompt, "completion_tokens": record.n_gen,
            "total_tokens": record.n_prompt + record.n_gen,
            "prompt_tokens_details": {"cached_tokens": record.n_cached},
            "prefixlab": token_parts(record, diverged_from)}


def token_parts(record, diverged_from: str | None) -> dict:
    """The tenant's own account (never another namespace's traffic: `isolated` is `new` and
    `diverged_at` looks only within its namespace); `diverged_from` is the completion id of the
    tenant's own earlier request its prompt departs from (the server maps the scheduler's
    request id, which counts every tenant's requests); an eviction names its budget, not when
    or during whose request."""
    tenant = record.tenant or Account(TokenParts(new=record.n_prompt))
    out = {"tokens": tenant.parts.as_dict(), "diverged_at": tenant.diverged_at,
           "diverged_from": diverged_from}
    if tenant.evicted_by is not None:
        out["evicted_by"] = {"cause": tenant.evicted_by.cause, "budget_pages": tenant.evicted_by.budget_pages}
    return out


def timings(record) -> dict:
    """llama.cpp's `timings` object, from a finished RequestRecord."""
    prompt_ms = (record.ttft_s or 0.0) * 1e3
    prompt_n = record.n_prompt - record.n_cached
    tps = record.decode_tps or 0.0
    predicted_ms = (record.n_gen - 1) / tps * 1e3 if tps and record.n_gen > 1 else 0.0
    return {
        "cache_n": record.n_cached, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": prompt_n / prompt_ms * 1e3 if prompt_ms else 0.0,
        "predicted_n": record.n_gen, "predicted_ms": predicted_ms,
        "predicted_per_token_ms": 1e3 / tps if tps else 0.0, "predicted_per_second": tps,
    }


def response(req: ParsedRequest, rid: str, model_id: str, text: str, finish: str, record,
             diverged_from: str | None) -> dict:
    """The whole (non-streaming) answer."""
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion" if req.chat else "text_completion",
            "created": int(time.time()), "model": model_id, "choices": [choice],
            "system_fingerprint": None, "usage": usage(record, diverged_from), "timings": timings(record)}


def chunk(req: ParsedRequest, rid: str, model_id: str, text: str | None = None,
          finish: str | None = None, role: bool = False) -> dict:
    """One streamed chunk: a delta (chat) or a text piece (completions)."""
    if req.chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    out = {"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion",
           "created": int(time.time()), "model": model_id, "choices": [choice], "system_fingerprint": None}
    if req.include_usage:
        out["usage"] = None
    return out


def usage_chunk(req: ParsedRequest, rid: str, model_id: str, record, diverged_from: str | None) -> dict:
    """The last chunk when `stream_options.include_usage` asks: no choices, the usage and timings."""
    return {"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": int(time.time()), "model": model_id, "choices": [], "system_fingerprint": None,
            "usage": usage(record, diverged_from), "timings": timings(record)}


class StopFilter:
    """Cuts generated text at the first stop string, holding back any text that may begin one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Text that is safe to send now; sets `stopped` once a stop string appears."""
        if self.stopped:
            return ""
        buf = self._held + piece
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return buf[:min(hits)]
        keep = 0
        for k in range(min(len(buf), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(buf[-k:]) for s in self.stops):
                keep = k
                break
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """What was held back, when the answer ends without a stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
