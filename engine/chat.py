"""Chat: templates (compiled once, rendered in a bounded sandbox), conversations, turn tokens.

A conversation's turn N+1 prompt is turn N's tokens (prompt, answer and the template's
closing tokens) plus the new messages, so it extends them token for token and hits the
cache. Conversations are immutable values: a turn builds the next value and the scheduler
stores it only when the turn finishes, so a refused, failed or cancelled turn changes nothing.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from .chat_templates import BASE_MODEL_NOTE, family_template
from .errors import TemplateError

if TYPE_CHECKING:
    from .tokenizer import TextTokenizer

# Positions kept free after an answer for the template's end-of-turn tokens (ChatML: 2).
CLOSING_SLACK = 4

# A plain ChatML template used when the GGUF has none or its own one fails.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _raise_exception(message):
    raise TemplateError(f"chat template raised: {message}")


# A chat template comes from an untrusted GGUF: besides the sandbox's attribute rules,
# refuse the cheap ways to ask for gigabytes ('a' * 10**9, x|center(10**9), '%999999999d').
MAX_TEMPLATE_NUMBER = 100_000     # the largest int a template may pass to a call or filter
MAX_TEMPLATE_CHARS = 1 << 20      # the largest string/list an operator or the output may make
_HUGE_WIDTH = re.compile(r"%[-#0 +]*(\*|\d{6,})|%[-#0 +]*\d*\.(\*|\d{6,})|\{[^{}]*:[^{}]*\d{6,}")


def _check_numbers(values) -> None:
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_TEMPLATE_NUMBER:
            raise SecurityError(f"number {v} is too large for a chat template "
                                f"(limit {MAX_TEMPLATE_NUMBER})")


def _bounded_filter(f):
    @functools.wraps(f)  # keeps jinja's pass_context/pass_environment marks
    def wrapper(*args, **kwargs):
        _check_numbers(args)
        _check_numbers(kwargs.values())
        return f(*args, **kwargs)
    return wrapper


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja2's immutable sandbox with limits on the sizes a template can ask for."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.filters = {name: _bounded_filter(f) for name, f in self.filters.items()}

    def call_binop(self, context, operator, left, right):
        sized = (str, list, tuple)
        if operator == "*" and isinstance(left, sized) != isinstance(right, sized):
            seq, n = (left, right) if isinstance(left, sized) else (right, left)
            if isinstance(n, int) and len(seq) * n > MAX_TEMPLATE_CHARS:
                raise SecurityError(f"'*' would make {len(seq) * n} items "
                                    f"(limit {MAX_TEMPLATE_CHARS})")
        elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
            if len(left) + len(right) > MAX_TEMPLATE_CHARS:
                raise SecurityError(f"'+' would make {len(left) + len(right)} items "
                                    f"(limit {MAX_TEMPLATE_CHARS})")
        elif operator == "**" and isinstance(right, int | float) and abs(right) > 1024:
            raise SecurityError(f"exponent {right} is too large for a chat template")
        elif operator == "%" and isinstance(left, str):
            if _HUGE_WIDTH.search(left):
                raise SecurityError("format width or precision too large for a chat template")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
        _check_numbers(args)
        _check_numbers(kwargs.values())
        target = getattr(__obj, "__wrapped__", __obj)
        if getattr(target, "__name__", "") in ("format", "format_map") and isinstance(
                getattr(target, "__self__", None), str) and _HUGE_WIDTH.search(target.__self__):
            raise SecurityError("format width or precision too large for a chat template")
        return super().call(__context, __obj, *args, **kwargs)


@functools.lru_cache(maxsize=32)
def compile_template(template: str) -> Template:
    """Compile a chat template once (per distinct source) in the bounded sandbox."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(template)
    except SecurityError as e:
        raise TemplateError(f"chat template blocked by the sandbox: {e}") from e
    except Exception as e:  # syntax errors
        raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


def render_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                    **extra) -> str:
    """Render an untrusted chat template in a bounded, immutable sandbox."""
    compiled = compile_template(template)
    try:
        pieces, size = [], 0
        for piece in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                       **extra):
            size += len(piece)
            if size > MAX_TEMPLATE_CHARS:
                raise TemplateError(f"chat template output exceeds {MAX_TEMPLATE_CHARS} characters")
            pieces.append(piece)
        return "".join(pieces)
    except SecurityError as e:
        raise TemplateError(f"chat template blocked by the sandbox: {e}") from e
    except TemplateError:
        raise
    except Exception as e:  # undefined names, type errors
        raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


def checked_template(template: str | None, arch: str | None = None) -> tuple[str, str]:
    """The template to use and a warning when the GGUF's own one is missing or unusable.

    The fallback is the architecture's known turn format (Gemma's for gemma3), else plain ChatML.
    """
    family = family_template(arch)
    name, fallback = family if family else ("plain ChatML", FALLBACK_TEMPLATE)
    if not template:
        return fallback, f"the model has no chat template; using {name} ({BASE_MODEL_NOTE})"
    probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
             {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
    try:
        render_template(template, probe, True, bos_token="", eos_token="")
    except TemplateError as e:
        return fallback, f"{e}; using {name} instead"
    return template, ""


# conversations -----------------------------------------------------------------


def turn_messages(system: str | None, user: str) -> list[dict]:
    """A first turn's messages: the system prompt (when given) and the user's message."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def chat_prompt(tok: TextTokenizer, messages: list[dict]) -> list[int]:
    """The tokens of a first turn: the template over `messages`, with the generation prompt.

    A whole prompt: it starts with BOS when the model wants one (Gemma), whether or not the
    template writes it, and never with two.
    """
    return tok.encode_prompt(tok.render_chat(messages, add_generation_prompt=True))


@dataclass(frozen=True)
class Conversation:
    """A chat whose turns extend each other token for token, so each turn hits the last."""

    id: str
    namespace: str = ""
    messages: tuple[dict, ...] = ()
    history_tokens: tuple[int, ...] = ()  # the last finished turn: prompt, answer, closing tokens


@dataclass(frozen=True)
class Turn:
    """A turn in flight: the conversation it extends, every message so far, and its prompt."""

    conversation: Conversation
    messages: tuple[dict, ...]
    prompt: tuple[int, ...]


def start_turn(tok: TextTokenizer, conv: Conversation, new: list[dict]) -> Turn:
    """The next turn of `conv` with the `new` messages (a follow-up drops its system messages)."""
    if conv.history_tokens:  # the system prompt is already in the history
        new = [m for m in new if m.get("role") != "system"]
    messages = conv.messages + tuple(new)
    before = tok.render_chat(list(conv.messages), add_generation_prompt=False)
    after = tok.render_chat(list(messages), add_generation_prompt=True)
    if conv.history_tokens and after.startswith(before):
        prompt = conv.history_tokens + tuple(tok.encode(after[len(before):]))
    else:
        prompt = tuple(tok.encode_prompt(after))
    return Turn(conv, messages, prompt)


def finish_turn(tok: TextTokenizer, turn: Turn, answer_ids: list[int]) -> Conversation:
    """The conversation after `turn` answered `answer_ids` (stop token excluded): its history
    is the prompt, the answer and the template's closing tokens, what the next turn starts with."""
    answer = tok.decode(answer_ids)
    prev = tok.render_chat(list(turn.messages), add_generation_prompt=True)
    messages = turn.messages + ({"role": "assistant", "content": answer},)
    full = tok.render_chat(list(messages), add_generation_prompt=False)
    closing = tok.encode(full[len(prev) + len(answer):]) if full.startswith(prev + answer) else []
    conv = turn.conversation
    return Conversation(conv.id, conv.namespace, messages,
                        turn.prompt + tuple(int(t) for t in answer_ids) + tuple(closing))
