"""A card per prompt: its transcript streaming in, badges (cached, TTFT, tok/s, finish), follow-ups."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor, QFont, QTextBlockFormat, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QSizePolicy,
    QTextEdit,
    QVBoxLayout,
)

from engine.metrics import hit_rate

from .flow_layout import FlowLayout
from .format import secs
from .parts_bar import PartsBar, parts_html
from .theme import card_button, color, repolish

CARD_MIN_WIDTH = 240  # four badges on two lines, the answer wrapped
CARD_HEIGHT = 250


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
    """Draws one prompt's Transcript: the answer streams in as the controller hands over its text."""

    stop_clicked = Signal(str)             # uid
    run_clicked = Signal(str)              # uid: run this prompt again, as a new conversation
    followup_submitted = Signal(str, str)  # uid, text

    def __init__(self, transcript, parent=None):  # app/desktop/transcript.py's Transcript
        super().__init__(parent)
        self.transcript = transcript
        self.uid = uid = transcript.uid
        self.setObjectName("streamCard")
        self.setProperty("state", "idle")
        self.setMinimumWidth(CARD_MIN_WIDTH)
        self.setFixedHeight(CARD_HEIGHT)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

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
        self.run_button = card_button("run-one", "Run this prompt again (a new conversation)",
                                       lambda: self.run_clicked.emit(self.uid), size=16)
        self.stop_button = card_button("stop", "Stop this stream", lambda: self.stop_clicked.emit(self.uid),
                                       size=16)
        self.stop_button.setEnabled(False)
        head.addWidget(self.run_button)
        head.addWidget(self.stop_button)
        lay.addLayout(head)

        badges = FlowLayout(spacing=4)  # the badges wrap in a narrow column, never cut
        self.badge_cache = _badge("cache")
        self.badge_ttft = _badge()
        self.badge_tps = _badge()
        self.badge_reason = _badge()
        for b in (self.badge_cache, self.badge_ttft, self.badge_tps, self.badge_reason):
            badges.addWidget(b)
        lay.addLayout(badges)
        self.parts_bar = PartsBar()  # where the prompt's tokens went; the words on hover
        lay.addWidget(self.parts_bar)

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
        self.send_button = card_button("send", "Send the follow-up", self._send_followup, size=16)
        foot.addWidget(self.followup, 1)
        foot.addWidget(self.send_button)
        lay.addLayout(foot)
        self.set_title(transcript.title)
        self.rerender()
        if transcript.turns:  # a restored transcript
            self._show_record_badges(transcript.turns[-1])
            self._set_state("done")
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


    # state --------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.transcript.running

    @property
    def turns(self) -> list:
        return self.transcript.turns

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
        can_follow = self.transcript.can_follow_up()
        self.followup.setEnabled(can_follow)
        self.send_button.setEnabled(can_follow)

    def set_title(self, text: str) -> None:
        self.transcript.title = text
        self.title.setText(text)
        self.title.setToolTip(text)

    # a turn's life, drawn as the controller reports it ------------------------------
    def show_turn_started(self) -> None:
        """A turn was submitted: show the user's message and wait for the answer."""
        turns = self.turns
        turn = turns[-1]
        first_of_run = len(turns) == 1 or turns[-2].run != turn.run
        self._render_turn_head(turn, separator=first_of_run and len(turns) > 1)
        _set_badge(self.badge_reason, "queued", "running", "Waiting for the scheduler")
        self.badge_ttft.hide()
        self.badge_tps.hide()
        self.badge_cache.hide()
        self.parts_bar.set_parts(None)
        self._set_state("queued")

    def show_accepted(self) -> None:
        """The scheduler accepted the turn."""
        t = self.transcript
        _set_badge(self.badge_cache, f"prompt {t.n_prompt} tok", "nocache", "Waiting to be admitted")
        _set_badge(self.badge_reason, "running", "running", f"request {t.request_id}")
        self._set_state("running")

    def show_text(self, text: str) -> None:
        """Append answer text (one insert; the view stays at the bottom if it was there)."""
        bar = self.view.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        cursor = QTextCursor(self.view.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertText(text, self._answer_format())
        if at_bottom:
            bar.setValue(bar.maximum())
        rate = self.transcript.decode_rate()
        if rate is not None:
            _set_badge(self.badge_tps, f"{rate:.1f} tok/s", "", "Decode speed so far")

    def update_live(self, record) -> None:
        """Badges from a running request's record (from a stats snapshot)."""
        if record.id != self.transcript.request_id or not self.running:
            return
        if record.n_cached or record.n_prefilled:
            self._cache_badge(record.n_cached, record.n_prompt)
        if record.parts is not None:
            self._show_parts(record.parts.as_dict(), record.diverged_at, record.diverged_words)
        if record.ttft_s is not None:
            _set_badge(self.badge_ttft, f"TTFT {secs(record.ttft_s)}", "", "Time to first token")

    def show_finished(self) -> None:
        """The request ended (stop, length or cancelled): final badges; the text stays."""
        if not self.turns:
            return
        turn = self.turns[-1]
        self._show_record_badges(turn)
        if turn.reason == "cancelled":
            cursor = QTextCursor(self.view.document())
            cursor.movePosition(QTextCursor.MoveOperation.End)
            cursor.insertText("  [stopped]", self._note_format(color("stopped")))
        self._set_state("done")

    def show_refused(self, message: str) -> None:
        """The scheduler refused the turn: say why in the transcript."""
        cursor = QTextCursor(self.view.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertText(f"Refused: {message}", self._note_format(color("error")))
        _set_badge(self.badge_reason, "refused", "error", message)
        self._set_state("done")

    def _send_followup(self) -> None:
        text = self.followup.text().strip()
        if text and self.followup.isEnabled():
            self.followup.clear()
            self.followup_submitted.emit(self.uid, text)

    # text ---------------------------------------------------------------------
    def answer_text(self) -> str:
        """The latest turn's answer (pending pieces included)."""
        return self.transcript.answer_text()

    def transcript_text(self) -> str:
        """The transcript as drawn."""
        return self.view.toPlainText()

    def rerender(self) -> None:
        """Draw the whole transcript again (after a restore or a theme change)."""
        self._style_scroll_bar()
        self.view.clear()
        prev_run = None
        for i, t in enumerate(self.turns):  # a running turn's pending text comes at the next flush
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

    def _render_turn_head(self, turn, separator: bool) -> None:
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
        pct = 100 * hit_rate(n_cached, n_prompt - n_cached)
        # short: the four badges share a card's width (a longer one was clipped in a narrow column)
        _set_badge(self.badge_cache, f"cached {n_cached}/{n_prompt}", kind,
                   f"{n_cached} of the prompt's {n_prompt} tokens came from the prefix cache ({pct:.0f}%)")

    def _show_parts(self, parts: dict | None, diverged_at: int | None, words: str) -> None:
        """The thin bar of where the prompt's tokens went; the cache badge's tip says it too."""
        self.parts_bar.set_parts(parts, diverged_at, words)
        if parts:
            self.badge_cache.setToolTip(parts_html(parts, diverged_at, words))

    def parts_shown(self) -> dict[str, int]:
        """The bar's parts now, {part: tokens} (`cached` without its `disk` share)."""
        return self.parts_bar.shown()

    def _show_record_badges(self, turn) -> None:
        r = turn.record
        if not r:
            _set_badge(self.badge_reason, turn.reason or "?", "error" if turn.reason == "refused" else "")
            return
        self._cache_badge(int(r.get("n_cached") or 0), int(r.get("n_prompt") or 0))
        self._show_parts(r.get("parts"), r.get("diverged_at"), r.get("diverged_words") or "")
        if r.get("ttft_s") is not None:
            _set_badge(self.badge_ttft, f"TTFT {secs(r['ttft_s'])}", "",
                       f"Time to first token (queue wait {secs(r.get('queue_wait_s') or 0)})")
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
