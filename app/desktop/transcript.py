"""One prompt's conversation as plain data: its turns, the turn running now, its pending pieces.

No Qt here: the app's controller writes a Transcript, a stream card draws it, and the
session file stores `to_dict()` (the format of every earlier version, so old sessions load).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# What a finished turn keeps of its RequestRecord (the badges and the session file read these).
RECORD_FIELDS = ("id", "n_prompt", "n_cached", "n_prefilled", "n_gen", "ttft_s", "decode_tps", "queue_wait_s",
                 "finish_reason", "chain_hit", "chain_donated")
COMPLETED = ("stop", "length")  # turns that stay in the conversation; stopped or refused ones do not


@dataclass
class Turn:
    """One user message and the answer it got (kept forever: the transcript is never cleared)."""

    user: str
    conversation_id: str
    run: int
    answer: str = ""
    reason: str | None = None       # stop | length | cancelled | refused | None while running
    record: dict = field(default_factory=dict)
    error: str = ""

    def to_dict(self) -> dict:
        return {"user": self.user, "conversation_id": self.conversation_id, "run": self.run,
                "answer": self.answer, "reason": self.reason, "record": self.record, "error": self.error}

    @classmethod
    def from_dict(cls, d: dict) -> Turn:
        return cls(user=str(d.get("user", "")), conversation_id=str(d.get("conversation_id", "")),
                   run=int(d.get("run", 1)), answer=str(d.get("answer", "")), reason=d.get("reason"),
                   record=dict(d.get("record") or {}), error=str(d.get("error", "")))


class Transcript:
    """Every turn of one prompt's card, and the state of the turn that runs now."""

    def __init__(self, uid: str, title: str = ""):
        self.uid = uid
        self.title = title
        self.turns: list[Turn] = []
        self.conversation_id: str | None = None
        self.run_number = 0
        self.system = ""
        self.running = False
        self.request_id: int | None = None
        self.n_prompt = 0
        self.pending: list[str] = []
        self.first_piece_at: float | None = None
        self.pieces = 0

    # a turn's life ------------------------------------------------------------
    def start_conversation(self, conversation_id: str, system: str) -> None:
        """The next turn starts a new conversation (Run / Run all); earlier turns stay."""
        self.run_number += 1
        self.conversation_id = conversation_id
        self.system = system

    def begin_turn(self, user: str) -> Turn:
        """A turn was submitted; it waits for the scheduler."""
        turn = Turn(user=user, conversation_id=self.conversation_id or "", run=self.run_number)
        self.turns.append(turn)
        self.running = True
        self.request_id = None
        self.pending.clear()
        self.first_piece_at = None
        self.pieces = 0
        return turn

    def accept(self, request_id: int, n_prompt: int) -> None:
        """The scheduler took the turn as request `request_id`."""
        self.request_id = request_id
        self.n_prompt = n_prompt

    def add_piece(self, text: str) -> None:
        """A piece of the answer; it joins the answer at the next `take_pending`."""
        if not text:
            return
        if self.first_piece_at is None:
            self.first_piece_at = time.perf_counter()
        self.pieces += 1
        self.pending.append(text)

    def take_pending(self) -> str:
        """Move the pending pieces into the answer; return them as one text."""
        if not self.pending or not self.turns:
            return ""
        text = "".join(self.pending)
        self.pending.clear()
        self.turns[-1].answer += text
        return text

    def decode_rate(self) -> float | None:
        """Tokens per second since the first piece of the running turn (None before two pieces)."""
        if self.first_piece_at is None or self.pieces < 2:
            return None
        dt = time.perf_counter() - self.first_piece_at
        return (self.pieces - 1) / dt if dt > 0 else None

    def finish(self, record) -> None:
        """The request ended (stop, length or cancelled); call `take_pending` first."""
        self.running = False
        self.request_id = None
        if not self.turns:
            return
        turn = self.turns[-1]
        turn.reason = record.finish_reason
        if record.text and len(record.text) >= len(turn.answer):
            turn.answer = record.text  # the scheduler's text is authoritative (split UTF-8 pieces)
        turn.record = {k: getattr(record, k) for k in RECORD_FIELDS}
        if record.parts is not None:  # where its prompt tokens went (docs/design.md §15)
            turn.record.update(parts=record.parts.as_dict(), diverged_at=record.diverged_at,
                               diverged_words=record.diverged_words)

    def refuse(self, message: str) -> None:
        """The scheduler refused the turn."""
        self.running = False
        self.request_id = None
        if self.turns:
            self.turns[-1].reason = "refused"
            self.turns[-1].error = message

    # the conversation ------------------------------------------------------------
    def conversation_turns(self) -> list[Turn]:
        return [t for t in self.turns if t.conversation_id == self.conversation_id]

    def can_follow_up(self) -> bool:
        return not self.running and any(t.reason in COMPLETED for t in self.conversation_turns())

    def first_message(self) -> str | None:
        """The user message that opened the current conversation (a rerun sends it again)."""
        turns = self.conversation_turns()
        return turns[0].user if turns else None

    def history_messages(self, new_user: str) -> list[dict]:
        """Chat messages of this conversation's completed turns plus `new_user` (stopped turns
        are left out, as the scheduler leaves them out of the conversation)."""
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for t in self.conversation_turns():
            if t.reason in COMPLETED:
                msgs += [{"role": "user", "content": t.user}, {"role": "assistant", "content": t.answer}]
        return msgs + [{"role": "user", "content": new_user}]

    def answer_text(self) -> str:
        """The latest turn's answer (pending pieces included)."""
        if not self.turns:
            return ""
        return self.turns[-1].answer + "".join(self.pending)

    # the session file ----------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"uid": self.uid, "title": self.title, "system": self.system,
                "conversation_id": self.conversation_id, "run_number": self.run_number,
                "turns": [t.to_dict() for t in self.turns]}

    @classmethod
    def from_dict(cls, data: dict) -> Transcript:
        """Rebuild from `to_dict` output (a restored session); nothing is running."""
        t = cls(str(data["uid"]), str(data.get("title", "")))
        t.system = str(data.get("system", ""))
        t.conversation_id = data.get("conversation_id")
        t.run_number = int(data.get("run_number", 0))
        t.turns = [Turn.from_dict(d) for d in data.get("turns", [])]
        for turn in t.turns:
            if turn.reason is None:
                turn.reason = "cancelled"  # it was running when the app closed
        return t
