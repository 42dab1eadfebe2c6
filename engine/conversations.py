"""The chat front end: chat messages and conversations in, token requests out (docs/design.md §4).

The scheduler knows token requests only. A chat turn becomes one here: the template renders
the messages, a follow-up extends its conversation's last turn token for token (so it hits
the cache), and the request's `closing` hook, called when the turn ends, stores the finished
conversation and hands the scheduler the template's closing tokens to run before it donates.
Use it on the thread that owns the scheduler (the engine loop's).
"""

from __future__ import annotations

import itertools

from .chat import Conversation, finish_turn, start_turn, turn_messages
from .stream import Request, SubmitRefused
from .tokenizer import TextTokenizer


class ChatFrontEnd:
    """Conversations by id, and the token requests of their turns."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self._conversations: dict[str, Conversation] = {}
        self._running: dict[str, Request] = {}  # conversation id -> its open turn's request
        self._ids = itertools.count(1)

    def request(self, prompt: list[int] | None = None, *, messages: list[dict] | None = None,
                system: str | None = None, user: str | None = None, history: list[dict] | None = None,
                conversation_id: str | None = None, preview: str = "", **fields) -> Request:
        """A token request from prompt tokens, chat messages, or a system/user turn.

        With a `conversation_id` the conversation is kept and its next turn extends this one;
        `history` is the whole chat the caller kept, sent when this front end no longer knows
        the conversation (a new model or pool, or its first turn was stopped). Without an id a
        chat is one turn (an HTTP client resends the whole chat: the cache carries it over).
        `fields` are the other `Request` fields (sampling, max_new_tokens, namespace, ...).
        """
        if prompt is not None:
            return Request(prompt=[int(t) for t in prompt], preview=preview,
                           conversation_id=conversation_id, **fields)
        keep = conversation_id is not None
        cid = conversation_id or f"c{next(self._ids)}"
        if cid in self._running:
            raise SubmitRefused(f"conversation {cid} still has a turn running")
        conv = self._conversations.get(cid)
        if history and (conv is None or not conv.history_tokens):
            messages, conv = history, None
        elif messages is None:
            if user is None:
                raise SubmitRefused("a request needs prompt tokens, chat messages or a user message")
            messages = turn_messages(system, user)
        turn = start_turn(self.tokenizer, conv or Conversation(cid, fields.get("namespace", "")), messages)
        request = Request(prompt=list(turn.prompt), preview=preview or messages[-1]["content"][:60],
                          conversation_id=cid, **fields)

        def closing(answer: list[int]) -> list[int]:
            done = finish_turn(self.tokenizer, turn, answer)
            if keep:
                self._conversations[cid] = done
            return list(done.history_tokens)

        request.closing = closing
        self._running[cid] = request
        return request

    def ended(self, request: Request) -> None:
        """The request finished or was refused: its conversation may take a next turn."""
        cid = request.conversation_id
        if cid is not None and self._running.get(cid) is request:
            del self._running[cid]

    def kept(self) -> int:
        """How many conversations are kept."""
        return len(self._conversations)

    def conversation(self, conversation_id: str) -> Conversation | None:
        """The kept conversation: its messages and the tokens its next turn starts with."""
        return self._conversations.get(conversation_id)
