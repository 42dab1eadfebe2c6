"""What the scheduler moves around: its settings, a request in flight, one step's batch, events."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from .block_manager import BlockManager, Session, pages_for
from .chat import CLOSING_SLACK
from .config import ModelConfig
from .kv_pool import kv_dtype_name
from .metrics import RequestRecord
from .sampler import Sampler, SamplingParams
from .tokenizer import TokenStream

if TYPE_CHECKING:
    from .lending import Loan

# New tokens a request may generate when its front end does not say: the one default answer
# length (window, CLI, scenarios and engine alike; the server's is "up to the context", as OpenAI's).
MAX_NEW_TOKENS = 128


class SubmitRefused(ValueError):
    """A request the scheduler will not take; the message says why."""


class QueueFull(SubmitRefused):
    """The queue holds `max_queue` requests: a busy server, not a bad request (retry later)."""


@dataclass
class SchedulerSettings:
    """The scheduler's knobs (validated; the app remembers them)."""

    # Defaults measured on the W8 workload (8 requests sharing a system prompt, 2 cores):
    # 8 streams decode in one pass for ~1.1-1.5x one stream's cost, so 4 would double the
    # decode steps; a 512-token chunk (llama.cpp's n_ubatch) prefills the shared prompt and
    # the seven cached tails (309 tokens) in one pass. 256 took a second pass of 58 rows,
    # whose mid-size GEMMs cost 2-3 ms a row against 1.8 in the first (W8 whole process,
    # 5 interleaved runs: median 2.33 s at 256, 2.19 at 512); 128 took three (a burst of 8
    # HTTP clients 9.6 -> 7.8 s from 128 to 256 on 2 busy cores). The price is a longer
    # stall of the streams already decoding while a new prompt prefills (~1 s here).
    max_streams: int = 8
    max_queue: int = 32
    chunk_tokens: int = 512
    page_rows: int = 16
    pool_pages: int | None = None
    cache_pages: int = 0
    cache_enabled: bool = True
    # Speculative decoding from the prompt (n-gram drafts, engine/spec.py) is off by default:
    # measured on the 2-core machine it did not pay for the shipped workloads (8-question
    # scenario 2.98 s with it vs 2.73 s without; one stream 0.976x; W8 best 1.88 s vs 1.78 s).
    spec_enabled: bool = False
    spec_k: int = 4                # drafted tokens verified per stream and step, at most
    kv_dtype: str = "float32"      # how pages store K/V: "float32" or "float16" (docs/design.md §12)
    disk_tier_pages: int = 0       # pages of the disk tier under the pool (0: none)

    def validate(self) -> None:
        checks = [
            ("max_streams", self.max_streams, 1), ("max_queue", self.max_queue, 1),
            ("chunk_tokens", self.chunk_tokens, 1), ("page_rows", self.page_rows, 1),
            ("cache_pages", self.cache_pages, 0), ("spec_k", self.spec_k, 1),
            ("disk_tier_pages", self.disk_tier_pages, 0),
        ]
        self.kv_dtype = kv_dtype_name(self.kv_dtype)  # ValueError names the accepted ones
        if self.pool_pages is not None:
            checks.append(("pool_pages", self.pool_pages, 1))
        for name, value, low in checks:
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"bad scheduler setting: {name} must be an integer >= {low}, got {value!r}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Request:
    """What a front end hands the scheduler: token ids and how to run them (no chat in here).

    `closing`, when given, is called once on the scheduler's thread when the request ends by
    stop or length, with the answer's token ids (the stop token left out); it returns every
    token the turn consists of (prompt, answer, the template's closing tokens). The session
    evaluates the ones it has not before it donates, so the conversation's next turn hits.
    """

    prompt: list[int]
    sampling: SamplingParams | None = None
    max_new_tokens: int = MAX_NEW_TOKENS
    stop_ids: list[int] | None = None      # None: the model's end-of-turn tokens
    preview: str = ""
    namespace: str = ""
    conversation_id: str | None = None
    client: str = ""                       # where it came from (records, the Served view)
    arrival: float | None = None           # time.perf_counter() of its arrival; None: now
    closing: Callable[[list[int]], list[int]] | None = None


@dataclass
class TokenEvent:
    """A generated token and its text piece (empty while a UTF-8 character is split)."""

    request_id: int
    token_id: int
    text: str


@dataclass
class FinishEvent:
    """A request ended: stop, length or cancelled; its record has every number."""

    request_id: int
    reason: str
    record: RequestRecord

    @property
    def parts(self):
        """Where the request's prompt tokens went (engine/token_parts.py; None: never admitted)."""
        return self.record.parts


def reserved_positions(n_prompt: int, max_new_tokens: int, context_length: int) -> int:
    """Positions a request may fill: prompt, answer and the turn's closing tokens, within the context."""
    return min(n_prompt + max_new_tokens + CLOSING_SLACK, context_length)


def check_fits(prompt: list[int], max_new_tokens: int, cfg: ModelConfig, pool: BlockManager) -> int:
    """Refuse a prompt the model or the pool cannot take; return the positions to reserve."""
    if not prompt:
        raise SubmitRefused("the prompt is empty")
    if any(not 0 <= t < cfg.vocab_size for t in prompt):
        raise SubmitRefused(f"the prompt has a token outside the vocabulary (0..{cfg.vocab_size - 1})")
    if len(prompt) + 1 > cfg.context_length:
        raise SubmitRefused(f"the prompt has {len(prompt)} tokens; "
                            f"the model's context is {cfg.context_length}")
    positions = reserved_positions(len(prompt), max_new_tokens, cfg.context_length)
    need = pages_for(positions, pool.page_rows)
    if pool.max_pages is not None and need > pool.capacity:
        raise SubmitRefused(
            f"the request needs {need} KV pages ({len(prompt)} prompt + {max_new_tokens} new tokens) "
            f"but the pool has only {pool.capacity}")
    return positions


@dataclass
class Stream:
    """A request in flight: queued, prefilling, decoding, or closing (its turn's last tokens)."""

    record: RequestRecord
    prompt: list[int]
    sampler: Sampler
    max_new_tokens: int
    stop_ids: frozenset[int]
    text_stream: TokenStream
    arrival: float
    positions: int                     # reserved at admission: see reserved_positions
    closing_turn: Callable[[list[int]], list[int]] | None = None  # Request.closing
    session: Session | None = None
    generated: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    admitted_at: float = 0.0
    first_token_at: float | None = None
    cancel_requested: str | None = None  # the finish reason a requester asked for: "cancelled", or
                                         # "stop" (the server cut the answer at a stop string)
    finish_reason: str | None = None
    closing: list[int] = field(default_factory=list)  # the finished turn's unevaluated tail
    loan: Loan | None = None           # pages another stream is writing that this one shares
    published: list = field(default_factory=list)  # the cached pages its last publish walked

    @property
    def id(self) -> int:
        return self.record.id

    def pages_needed(self, page_rows: int) -> int:
        """The pages this request takes at admission: the one definition of its page need."""
        return pages_for(self.positions, page_rows)

    @property
    def prefilling(self) -> bool:
        return self.session is not None and self.session.n_past < len(self.prompt)

    @property
    def decoding(self) -> bool:
        return self.finish_reason is None and not self.prefilling and bool(self.generated)

    def recent(self, n: int) -> list[int]:
        """The last `n` tokens of prompt + answer (what a repeat penalty reads), without copying
        the whole history per sampled token."""
        if n <= 0:
            return []
        gen = self.generated
        if len(gen) >= n:
            return gen[-n:]
        return self.prompt[max(0, len(self.prompt) - (n - len(gen))):] + gen

    def accept(self, token: int, now: float, context_length: int) -> list[TokenEvent]:
        """Take a sampled token: a stop ends the stream unseen, others stream as an event."""
        if self.first_token_at is None:
            self.first_token_at = now
            self.record.ttft_s = now - self.arrival
        self.generated.append(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return []
        piece = self.text_stream.step(token)
        self.pieces.append(piece)
        self.record.n_gen += 1
        if self.record.n_gen >= self.max_new_tokens or self.session.n_past + 1 >= context_length:
            self.finish_reason = "length"
        return [TokenEvent(self.id, token, piece)]

    def close_record(self, now: float, t0: float) -> None:
        """Fill the record's end: reason, finish time (since t0), text, decode rate."""
        r = self.record
        r.finish_reason = self.finish_reason
        r.finished_s = now - t0
        r.text = "".join(self.pieces)
        if self.first_token_at is not None and r.n_gen > 1:
            r.decode_tps = (r.n_gen - 1) / max(now - self.first_token_at, 1e-9)

    def target(self) -> list[int]:
        """What the session will hold once its pending work ran: the prompt, or the whole turn."""
        return self.session.tokens + self.closing if self.closing else self.prompt


@dataclass
class Batch:
    """One step's plan: who leaves, who decodes, which prompt pieces prefill, which turns close."""

    cancelled: list[Stream] = field(default_factory=list)
    decode: list[Stream] = field(default_factory=list)
    prefill: list[tuple[Stream, list[int]]] = field(default_factory=list)
    closing: list[Stream] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)  # per decode stream: tokens to verify

    def sessions(self) -> list[Session]:
        return ([s.session for s in self.decode] + [s.session for s, _ in self.prefill]
                + [s.session for s in self.closing])

    def tokens(self) -> list[list[int]]:
        return ([[s.generated[-1]] + d for s, d in zip(self.decode, self.draft_lists())]
                + [piece for _, piece in self.prefill] + [s.closing for s in self.closing])

    def draft_lists(self) -> list[list[int]]:
        return self.drafts or [[] for _ in self.decode]

    def parts(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(positions before it, rows) of each decoding stream and of each prompt piece (a
        turn's closing tokens too): what the pass computes, read before it runs."""
        decode = [(s.session.n_past, 1 + len(d)) for s, d in zip(self.decode, self.draft_lists())]
        pieces = [(s.session.n_past, len(p)) for s, p in self.prefill]
        return decode, pieces + [(s.session.n_past, len(s.closing)) for s in self.closing]

    def prompts(self) -> list[bool]:
        """Per session, whether it gives prompt tokens (a prefill piece, a turn's closing
        tokens: the K/V a later prompt's cache hit reads) rather than decoded ones."""
        return [False] * len(self.decode) + [True] * (len(self.prefill) + len(self.closing))

    def n_logits(self) -> list[int] | None:
        """Logit rows per session: a decode stream's token plus its drafts, else its last token."""
        if not any(self.drafts):
            return None
        return [1 + len(d) for d in self.drafts] + [1] * (len(self.prefill) + len(self.closing))

    @property
    def n_prefill(self) -> int:
        return sum(len(p) for _, p in self.prefill)

    @property
    def size(self) -> int:
        """Tokens in the forward pass."""
        return (len(self.decode) + sum(map(len, self.drafts)) + self.n_prefill
                + sum(len(s.closing) for s in self.closing))
