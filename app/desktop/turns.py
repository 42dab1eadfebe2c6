"""The window's books, with no Qt: a transcript per prompt card, which card each open turn
belongs to (by tag, then by request id), and a scenario's scripted later turns."""

from __future__ import annotations

import secrets

from .transcript import Transcript


class TurnBook:
    """Transcripts by card uid, open turns by tag and request id, scripted turns by uid."""

    def __init__(self):
        self.transcripts: dict[str, Transcript] = {}
        self.scripts: dict[str, list[str]] = {}         # uid -> a scenario's later turns
        self._script_queue: dict[str, list[str]] = {}   # uid -> turns still to send in this run
        self._tag_uid: dict[str, str] = {}              # the open turns: tag -> card uid
        self._rid_tag: dict[int, str] = {}
        self._nonce = secrets.token_hex(3)              # conversation ids differ across app runs
        self._conversations = 0

    @property
    def running(self) -> int:
        """How many turns are submitted and not finished."""
        return len(self._tag_uid)

    def open_tags(self, uid: str | None = None) -> list[str]:
        """Tags of the open turns (of one card when `uid` is given)."""
        return [tag for tag, u in self._tag_uid.items() if uid is None or u == uid]

    def add(self, t: Transcript) -> Transcript:
        self.transcripts[t.uid] = t
        return t

    # turns going out ----------------------------------------------------------------------
    def first_turn(self, t: Transcript, text: str, system: str, tag: str, settings) -> dict:
        """Start a new conversation on the card and return its first turn's job."""
        self._conversations += 1
        t.start_conversation(f"{t.uid}-{self._conversations}-{self._nonce}", system)
        self._script_queue[t.uid] = list(self.scripts.get(t.uid, []))
        return self.turn(t, text, tag, settings, followup=False)

    def turn(self, t: Transcript, text: str, tag: str, settings, followup: bool = True) -> dict:
        """The job of a turn (its tag and `ChatFrontEnd.request` arguments), now open under `tag`."""
        job = {"tag": tag, "system": t.system, "user": text, "conversation_id": t.conversation_id,
               "max_new_tokens": settings.max_new_tokens, "namespace": settings.namespace,
               "sampling": settings.sampling()}
        if followup:
            job["history"] = t.history_messages(text)  # used when the engine no longer knows the chat
        t.begin_turn(text)
        self._tag_uid[tag] = t.uid
        return job

    def served(self, t: Transcript, request_id: int, user: str) -> None:
        """An HTTP request the server took: its card's turn, open under the request's id."""
        tag = f"http-{request_id}"
        t.start_conversation(tag, "")
        t.begin_turn(user)
        self._tag_uid[tag] = t.uid
        self._rid_tag[request_id] = tag

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
    def by_tag(self, tag: str | None) -> Transcript | None:
        uid = self._tag_uid.get(tag) if tag is not None else None
        return self.transcripts.get(uid) if uid is not None else None

    def by_request(self, request_id: int) -> Transcript | None:
        return self.by_tag(self._rid_tag.get(request_id))

    def accepted(self, tag: str, request_id: int) -> Transcript | None:
        """The worker took the turn of `tag` as `request_id`."""
        t = self.by_tag(tag)
        if t is not None:
            self._rid_tag[request_id] = tag
        return t

    def close_tag(self, tag: str | None) -> Transcript | None:
        """The turn of `tag` is over (refused); return its transcript."""
        t = self.by_tag(tag)
        self._tag_uid.pop(tag, None)
        return t

    def close_request(self, request_id: int) -> Transcript | None:
        """The request ended; return its transcript (None: not one of the cards')."""
        return self.close_tag(self._rid_tag.pop(request_id, None))

    # the session file -------------------------------------------------------------------------
    def session_cards(self, order: list[str]) -> list[dict]:
        return [self.transcripts[u].to_dict() for u in order if u in self.transcripts]

    def restore(self, data: dict) -> list[Transcript]:
        """Scripts and transcripts of a saved session (any earlier version's); return the transcripts."""
        self.scripts = {str(k): [str(x) for x in v] for k, v in data.get("scripts", {}).items()}
        return [self.add(Transcript.from_dict(cd)) for cd in data.get("cards", []) if cd.get("turns")]
