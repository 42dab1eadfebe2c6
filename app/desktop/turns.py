"""The window's books, with no Qt: a transcript per prompt card, which card each open turn
belongs to (by the engine loop's ticket, the turn's one id from submit to finish), and a
scenario's scripted later turns."""

from __future__ import annotations

import secrets

from .transcript import Transcript


class TurnBook:
    """Transcripts by card uid, open turns by ticket, scripted turns by uid."""

    def __init__(self):
        self.transcripts: dict[str, Transcript] = {}
        self.scripts: dict[str, list[str]] = {}         # uid -> a scenario's later turns
        self._script_queue: dict[str, list[str]] = {}   # uid -> turns still to send in this run
        self._open: dict[int, str] = {}                 # the open turns: ticket -> card uid
        self._nonce = secrets.token_hex(3)              # conversation ids differ across app runs
        self._conversations = 0

    @property
    def running(self) -> int:
        """How many turns are submitted and not finished."""
        return len(self._open)

    def open_tickets(self, uid: str | None = None) -> list[int]:
        """Tickets of the open turns (of one card when `uid` is given)."""
        return [ticket for ticket, u in self._open.items() if uid is None or u == uid]

    def add(self, t: Transcript) -> Transcript:
        self.transcripts[t.uid] = t
        return t

    # turns going out ----------------------------------------------------------------------
    def first_turn(self, t: Transcript, text: str, system: str, settings) -> dict:
        """Start a new conversation on the card and begin its first turn; return its request."""
        self._conversations += 1
        t.start_conversation(f"{t.uid}-{self._conversations}-{self._nonce}", system)
        self._script_queue[t.uid] = list(self.scripts.get(t.uid, []))
        return self.turn(t, text, settings, followup=False)

    def turn(self, t: Transcript, text: str, settings, followup: bool = True) -> dict:
        """Begin a turn on the card; return its `ChatFrontEnd.request` arguments (`opened` files
        it under its ticket once submitted)."""
        args = {"system": t.system, "user": text, "conversation_id": t.conversation_id,
                "max_new_tokens": settings.max_new_tokens, "namespace": settings.namespace,
                "sampling": settings.sampling()}
        if followup:
            args["history"] = t.history_messages(text)  # used when the engine no longer knows the chat
        t.begin_turn(text)
        return args

    def opened(self, t: Transcript, ticket: int) -> None:
        """The card's turn went to the engine loop as `ticket`."""
        self._open[ticket] = t.uid

    def served(self, t: Transcript, ticket: int, user: str) -> None:
        """An HTTP request the server took: its card's turn, open under the job's ticket."""
        t.start_conversation(f"http-{ticket}", "")
        t.begin_turn(user)
        self._open[ticket] = t.uid

    def next_scripted(self, uid: str) -> str | None:
        """The scenario's next turn for this card in this run, if any is left."""
        queue = self._script_queue.get(uid)
        return queue.pop(0) if queue else None

    def drop_scripts(self, uid: str | None = None) -> None:
        """No more scripted turns in this run (for one card, or all)."""
        if uid is None:
            self._script_queue.clear()
        else:
            self._script_queue.pop(uid, None)

    # turns coming back --------------------------------------------------------------------
    def by_ticket(self, ticket: int) -> Transcript | None:
        uid = self._open.get(ticket)
        return self.transcripts.get(uid) if uid is not None else None

    def close(self, ticket: int) -> Transcript | None:
        """The turn of `ticket` is over (finished or refused); return its transcript (None: not
        one of the cards')."""
        uid = self._open.pop(ticket, None)
        return self.transcripts.get(uid) if uid is not None else None

    # the session file -------------------------------------------------------------------------
    def session_cards(self, order: list[str]) -> list[dict]:
        return [self.transcripts[u].to_dict() for u in order if u in self.transcripts]

    def restore(self, data: dict) -> list[Transcript]:
        """Scripts and transcripts of a saved session (any earlier version's); return the transcripts."""
        self.scripts = {str(k): [str(x) for x in v] for k, v in data.get("scripts", {}).items()}
        return [self.add(Transcript.from_dict(cd)) for cd in data.get("cards", []) if cd.get("turns")]
