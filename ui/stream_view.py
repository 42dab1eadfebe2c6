"""A card per prompt: its transcript streaming in, badges (cached, TTFT, tok/s, finish), follow-ups."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtGui import QColor, QFont, QTextBlockFormat, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QScrollArea,
    QSizePolicy,
    QTextEdit,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from .theme import color, icon, repolish

CARD_MIN_WIDTH = 320
CARD_HEIGHT = 250


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


def _badge(kind: str = "") -> QLabel:
    label = QLabel()
    label.setProperty("badge", True)
    label.setProperty("kind", kind)
    label.hide()
    return label


def _set_badge(label: QLabel, text: str, kind: str = "", tip: str = "") -> None:
    label.setText(text)
    label.setToolTip(tip)
    if label.property("kind") != kind:
        label.setProperty("kind", kind)
        repolish(label)
    label.show()


class StreamView(QFrame):
    """One prompt's conversation: the answer streams in piece by piece (flushed on a timer)."""

    stop_clicked = Signal(str)             # uid
    run_clicked = Signal(str)              # uid: run this prompt again, as a new conversation
    followup_submitted = Signal(str, str)  # uid, text

    def __init__(self, uid: str, title: str, parent=None):
        super().__init__(parent)
        self.uid = uid
        self.setObjectName("streamCard")
        self.setProperty("state", "idle")
        self.setMinimumWidth(CARD_MIN_WIDTH)
        self.setFixedHeight(CARD_HEIGHT)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.turns: list[Turn] = []
        self.conversation_id: str | None = None
        self.run_number = 0
        self.system = ""
        self.tag: str | None = None
        self.request_id: int | None = None
        self.n_prompt = 0
        self._pending: list[str] = []
        self._first_piece_at: float | None = None
        self._pieces = 0

        lay = QVBoxLayout(self)
        lay.setContentsMargins(12, 10, 12, 10)
        lay.setSpacing(6)
        head = QHBoxLayout()
        head.setSpacing(6)
        self.tag_label = QLabel(uid.upper())
        self.tag_label.setObjectName("cardTag")
        head.addWidget(self.tag_label)
        self.title = QLabel()
        self.title.setObjectName("cardTitle")
        self.title.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        head.addWidget(self.title, 1)
        self.run_button = self._button("run-one", "Run this prompt again (a new conversation)",
                                       lambda: self.run_clicked.emit(self.uid))
        self.stop_button = self._button("stop", "Stop this stream", lambda: self.stop_clicked.emit(self.uid))
        self.stop_button.setEnabled(False)
        head.addWidget(self.run_button)
        head.addWidget(self.stop_button)
        lay.addLayout(head)

        badges = QHBoxLayout()
        badges.setSpacing(4)
        self.badge_cache = _badge("cache")
        self.badge_ttft = _badge()
        self.badge_tps = _badge()
        self.badge_reason = _badge()
        for b in (self.badge_cache, self.badge_ttft, self.badge_tps, self.badge_reason):
            badges.addWidget(b)
        badges.addStretch(1)
        lay.addLayout(badges)

        self.view = QTextEdit()
        self.view.setObjectName("transcript")
        self.view.setReadOnly(True)
        self.view.setAcceptRichText(False)
        self.view.setPlaceholderText("Not run yet. Press Run all (Ctrl+Enter) or ▶ on this card.")
        self._style_scroll_bar()
        lay.addWidget(self.view, 1)

        foot = QHBoxLayout()
        self.followup = QLineEdit()
        self.followup.setObjectName("followUp")
        self.followup.setPlaceholderText("Follow-up question (continues this conversation)…")
        self.followup.returnPressed.connect(self._send_followup)
        self.send_button = self._button("send", "Send the follow-up", self._send_followup)
        foot.addWidget(self.followup, 1)
        foot.addWidget(self.send_button)
        lay.addLayout(foot)
        self.set_title(title)
        self._update_controls()

    def _style_scroll_bar(self) -> None:
        """A thin scroll bar in the theme's colours for the transcript. The theme gives the
        transcript a transparent background, and Qt then draws its unstyled scroll bar with a
        black handle; a fully styled one does not depend on that background."""
        self.view.setStyleSheet(
            "QScrollBar:vertical { background: transparent; width: 8px; margin: 0; border: none; }"
            f"QScrollBar::handle:vertical {{ background: {color('border')}; border-radius: 4px;"
            " min-height: 24px; }"
            f"QScrollBar::handle:vertical:hover {{ background: {color('muted')}; }}"
            "QScrollBar::add-line:vertical, QScrollBar::sub-line:vertical"
            " { height: 0; border: none; background: none; }"
            "QScrollBar::add-page:vertical, QScrollBar::sub-page:vertical { background: none; }")

    def _button(self, name: str, tip: str, slot) -> QToolButton:
        b = QToolButton()
        b.setObjectName("cardButton")
        b.setIcon(icon(name))
        b.setIconSize(QSize(16, 16))
        b.setToolTip(tip)
        b.setAutoRaise(True)
        b.clicked.connect(slot)
        return b

    # state --------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.tag is not None

    @property
    def state(self) -> str:
        return str(self.property("state"))

    def _set_state(self, state: str) -> None:
        if self.property("state") != state:
            self.setProperty("state", state)
            repolish(self)
        self._update_controls()

    def _update_controls(self) -> None:
        running = self.running
        self.stop_button.setEnabled(running)
        self.run_button.setEnabled(not running)
        can_follow = not running and any(t.reason in ("stop", "length") for t in self._conversation_turns())
        self.followup.setEnabled(can_follow)
        self.send_button.setEnabled(can_follow)

    def set_title(self, text: str) -> None:
        self.title.setText(text)
        self.title.setToolTip(text)

    # a turn's life --------------------------------------------------------------
    def start_conversation(self, conversation_id: str, system: str) -> None:
        """The next turn starts a new conversation (Run / Run all); earlier turns stay shown."""
        self.run_number += 1
        self.conversation_id = conversation_id
        self.system = system

    def begin_turn(self, user: str, tag: str) -> Turn:
        """A turn was submitted: show the user's message and wait for the answer."""
        turn = Turn(user=user, conversation_id=self.conversation_id or "", run=self.run_number)
        first_of_run = not self.turns or self.turns[-1].run != turn.run
        self.turns.append(turn)
        self.tag = tag
        self.request_id = None
        self._pending.clear()
        self._first_piece_at = None
        self._pieces = 0
        self._render_turn_head(turn, separator=first_of_run and len(self.turns) > 1)
        _set_badge(self.badge_reason, "queued", "running", "Waiting for the scheduler")
        self.badge_ttft.hide()
        self.badge_tps.hide()
        self.badge_cache.hide()
        self._set_state("queued")
        return turn

    def set_request(self, request_id: int, n_prompt: int) -> None:
        """The scheduler accepted the turn as request `request_id`."""
        self.request_id = request_id
        self.n_prompt = n_prompt
        _set_badge(self.badge_cache, f"prompt {n_prompt} tok", "nocache", "Waiting to be admitted")
        _set_badge(self.badge_reason, "running", "running", f"request {request_id}")
        self._set_state("running")

    def append(self, text: str) -> None:
        """A piece of the answer; shown at the next flush (the window flushes on a timer)."""
        if not text:
            return
        if self._first_piece_at is None:
            self._first_piece_at = time.perf_counter()
        self._pieces += 1
        self._pending.append(text)

    @property
    def dirty(self) -> bool:
        return bool(self._pending)

    def flush(self) -> None:
        """Write the pending pieces into the transcript (one insert, keeps the view at the bottom)."""
        if not self._pending or not self.turns:
            return
        text = "".join(self._pending)
        self._pending.clear()
        self.turns[-1].answer += text
        bar = self.view.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        cursor = QTextCursor(self.view.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertText(text, self._answer_format())
        if at_bottom:
            bar.setValue(bar.maximum())
        if self._first_piece_at is not None and self._pieces > 1:
            dt = time.perf_counter() - self._first_piece_at
            if dt > 0:
                _set_badge(self.badge_tps, f"{(self._pieces - 1) / dt:.1f} tok/s", "", "Decode speed so far")

    def update_live(self, record) -> None:
        """Badges from a running request's record (from a stats snapshot)."""
        if record.id != self.request_id or not self.running:
            return
        if record.n_cached or record.n_prefilled:
            self._cache_badge(record.n_cached, record.n_prompt)
        if record.ttft_s is not None:
            _set_badge(self.badge_ttft, f"TTFT {_secs(record.ttft_s)}", "", "Time to first token")

    def finish(self, record) -> None:
        """The request ended (stop, length or cancelled): final badges; the text stays."""
        self.flush()
        if not self.turns:
            return
        turn = self.turns[-1]
        turn.reason = record.finish_reason
        if record.text and len(record.text) >= len(turn.answer):
            turn.answer = record.text  # the scheduler's text is authoritative (split UTF-8 pieces)
        turn.record = {k: getattr(record, k) for k in (
            "id", "n_prompt", "n_cached", "n_prefilled", "n_gen", "ttft_s", "decode_tps", "queue_wait_s",
            "finish_reason", "chain_hit", "chain_donated")}
        self.tag = None
        self.request_id = None
        self._show_record_badges(turn)
        if turn.reason == "cancelled":
            cursor = QTextCursor(self.view.document())
            cursor.movePosition(QTextCursor.MoveOperation.End)
            cursor.insertText("  [stopped]", self._note_format(color("stopped")))
        self._set_state("done")

    def refused(self, message: str) -> None:
        """The scheduler refused the turn: say why in the transcript."""
        self.flush()
        if self.turns:
            self.turns[-1].reason = "refused"
            self.turns[-1].error = message
        cursor = QTextCursor(self.view.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertText(f"Refused: {message}", self._note_format(color("error")))
        _set_badge(self.badge_reason, "refused", "error", message)
        self.tag = None
        self.request_id = None
        self._set_state("done")

    # conversation --------------------------------------------------------------
    def _conversation_turns(self) -> list[Turn]:
        return [t for t in self.turns if t.conversation_id == self.conversation_id]

    def history_messages(self, new_user: str) -> list[dict]:
        """Chat messages of this conversation's completed turns plus `new_user` (stopped turns
        are left out, as the scheduler leaves them out of the conversation)."""
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for t in self._conversation_turns():
            if t.reason in ("stop", "length"):
                msgs += [{"role": "user", "content": t.user}, {"role": "assistant", "content": t.answer}]
        return msgs + [{"role": "user", "content": new_user}]

    def _send_followup(self) -> None:
        text = self.followup.text().strip()
        if text and self.followup.isEnabled():
            self.followup.clear()
            self.followup_submitted.emit(self.uid, text)

    # text ---------------------------------------------------------------------
    def answer_text(self) -> str:
        """The latest turn's answer as shown (pending pieces included)."""
        if not self.turns:
            return ""
        return self.turns[-1].answer + "".join(self._pending)

    def transcript_text(self) -> str:
        return self.view.toPlainText()

    def to_dict(self) -> dict:
        return {"uid": self.uid, "title": self.title.text(), "system": self.system,
                "conversation_id": self.conversation_id, "run_number": self.run_number,
                "turns": [t.to_dict() for t in self.turns]}

    def restore(self, data: dict) -> None:
        """Rebuild from `to_dict` output (a restored session); nothing is running."""
        self.system = str(data.get("system", ""))
        self.conversation_id = data.get("conversation_id")
        self.run_number = int(data.get("run_number", 0))
        self.turns = [Turn.from_dict(t) for t in data.get("turns", [])]
        for t in self.turns:
            if t.reason is None:
                t.reason = "cancelled"  # it was running when the app closed
        self.rerender()
        if self.turns:
            self._show_record_badges(self.turns[-1])
            self._set_state("done")

    def rerender(self) -> None:
        """Draw the whole transcript again (after a restore or a theme change)."""
        self._style_scroll_bar()
        self.view.clear()
        prev_run = None
        for i, t in enumerate(self.turns):
            self._render_turn_head(t, separator=i > 0 and t.run != prev_run)
            prev_run = t.run
            cursor = QTextCursor(self.view.document())
            cursor.movePosition(QTextCursor.MoveOperation.End)
            cursor.insertText(t.answer, self._answer_format())
            if t.reason == "cancelled":
                cursor.insertText("  [stopped]", self._note_format(color("stopped")))
            elif t.reason == "refused":
                cursor.insertText(f"Refused: {t.error}", self._note_format(color("error")))
        self.view.verticalScrollBar().setValue(self.view.verticalScrollBar().maximum())

    def _render_turn_head(self, turn: Turn, separator: bool) -> None:
        cursor = QTextCursor(self.view.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        empty = self.view.document().isEmpty()
        block = QTextBlockFormat()
        block.setTopMargin(0 if empty else 6)
        if separator:
            sep = QTextBlockFormat()
            sep.setAlignment(Qt.AlignmentFlag.AlignHCenter)
            sep.setTopMargin(8)
            cursor.insertBlock(sep)
            cursor.insertText(f"— run {turn.run} —", self._note_format(color("muted")))
        if empty and not separator:
            cursor.setBlockFormat(block)
        else:
            cursor.insertBlock(block)
        who = QTextCharFormat()
        who.setFontWeight(QFont.Weight.Bold)
        who.setForeground(QColor(color("user")))
        cursor.insertText("You  ", who)
        user = QTextCharFormat()
        user.setForeground(QColor(color("user")))
        cursor.insertText(turn.user, user)
        cursor.insertBlock(QTextBlockFormat())
        cursor.setCharFormat(self._answer_format())

    def _answer_format(self) -> QTextCharFormat:
        fmt = QTextCharFormat()
        fmt.setForeground(QColor(color("text")))
        return fmt

    def _note_format(self, colour: str) -> QTextCharFormat:
        fmt = QTextCharFormat()
        fmt.setForeground(QColor(colour))
        fmt.setFontItalic(True)
        return fmt

    def _cache_badge(self, n_cached: int, n_prompt: int) -> None:
        kind = "cache" if n_cached else "nocache"
        pct = 100 * n_cached / n_prompt if n_prompt else 0
        _set_badge(self.badge_cache, f"cached {n_cached} of {n_prompt}", kind,
                   f"{n_cached} of the prompt's {n_prompt} tokens came from the prefix cache ({pct:.0f}%)")

    def _show_record_badges(self, turn: Turn) -> None:
        r = turn.record
        if not r:
            _set_badge(self.badge_reason, turn.reason or "?", "error" if turn.reason == "refused" else "")
            return
        self._cache_badge(int(r.get("n_cached") or 0), int(r.get("n_prompt") or 0))
        if r.get("ttft_s") is not None:
            _set_badge(self.badge_ttft, f"TTFT {_secs(r['ttft_s'])}", "",
                       f"Time to first token (queue wait {_secs(r.get('queue_wait_s') or 0)})")
        else:
            self.badge_ttft.hide()
        if r.get("decode_tps"):
            _set_badge(self.badge_tps, f"{r['decode_tps']:.1f} tok/s", "",
                       f"{r.get('n_gen', 0)} tokens generated")
        else:
            self.badge_tps.hide()
        reason = turn.reason or "?"
        _set_badge(self.badge_reason, reason, reason,
                   {"stop": "The model ended its answer", "length": "Reached max new tokens",
                    "cancelled": "Stopped by you"}.get(reason, reason))


def _secs(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


class StreamGrid(QScrollArea):
    """Stream cards in a grid whose column count follows the width."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("streamArea")
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.container = QWidget()
        self.container.setObjectName("streamGrid")
        self.grid = QGridLayout(self.container)
        self.grid.setContentsMargins(4, 4, 4, 4)
        self.grid.setSpacing(10)
        self.grid.setAlignment(Qt.AlignmentFlag.AlignTop)
        self.empty = QLabel("Type a system prompt and a few user prompts on the left,\n"
                            "then press Run all (Ctrl+Enter).\n\nOr load a scenario: File → Scenarios.")
        self.empty.setObjectName("emptyState")
        self.empty.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.grid.addWidget(self.empty, 0, 0)
        self.setWidget(self.container)
        self.cards: dict[str, StreamView] = {}
        self._order: list[str] = []
        self._columns = 0

    def card(self, uid: str) -> StreamView | None:
        return self.cards.get(uid)

    def add(self, card: StreamView) -> StreamView:
        self.cards[card.uid] = card
        self._order.append(card.uid)
        self._relayout(force=True)
        return card

    def order(self, uids: list[str]) -> None:
        """Show cards of these uids first, in this order (the prompt list's order)."""
        rest = [u for u in self._order if u not in uids]
        new = [u for u in uids if u in self.cards] + rest
        if new != self._order:
            self._order = new
            self._relayout(force=True)

    def ensure_visible(self, uid: str) -> None:
        card = self.cards.get(uid)
        if card is not None:
            self.ensureWidgetVisible(card, 0, 0)

    def _column_count(self) -> int:
        width = self.viewport().width()
        return max(1, min(3, width // (CARD_MIN_WIDTH + 20)))

    def _relayout(self, force: bool = False) -> None:
        cols = self._column_count()
        if not force and cols == self._columns:
            return
        self._columns = cols
        self.empty.setVisible(not self.cards)
        for card in self.cards.values():
            self.grid.removeWidget(card)
        for c in range(3):
            self.grid.setColumnStretch(c, 1 if c < cols else 0)
        for i, uid in enumerate(self._order):
            self.grid.addWidget(self.cards[uid], i // cols, i % cols)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt override
        super().resizeEvent(event)
        self._relayout()
