"""'Why it missed': how far a prompt matches the cache, why the match stops, the first differing token."""

from __future__ import annotations

import html

from PySide6.QtCore import QEvent, Qt
from PySide6.QtWidgets import QFrame, QLabel, QScrollArea, QSizePolicy, QVBoxLayout, QWidget

from .colors import PART_COLORS, SERIES_COLORS, Theme, theme_for
from .parts_bar import segments

REASONS = {
    "cap": ("capped", "the last page is kept for the model to compute at least one token"),
    "miss": ("miss", "no cached page starts like this"),
    "token_mismatch": ("token mismatch", "a cached page has the same hash but different tokens"),
    "end": ("end of the prompt", "the prompt has no more full pages"),
}
EMPTY_TEXT = ("Select a prompt and press <b>Explain miss</b> to see how far it matches the cache "
              "and why the match stops.")


def reason_words(stop_reason: str) -> tuple[str, str]:
    """(short name, plain-words explanation) of a probe's stop reason."""
    return REASONS.get(stop_reason, (stop_reason or "unknown", "the probe gave no known reason"))


def visible_text(text: str, spaces: bool = False) -> str:
    """HTML-escaped text with line breaks (and, if asked, spaces) drawn as visible marks."""
    out = html.escape(text, quote=True).replace("\n", "↵").replace("\t", "→").replace("\r", "␍")
    return out.replace(" ", "·") if spaces else out


def probe_html(info: dict, theme: Theme) -> str:
    """The rich text for one probe result; every text from the prompt or the cache is escaped."""
    matched = int(info.get("matched_tokens") or 0)
    pages = int(info.get("matched_pages") or 0)
    n_prompt = int(info.get("n_prompt") or 0)
    reason = str(info.get("stop_reason") or "")
    short, words = reason_words(reason)
    pct = 100.0 * matched / n_prompt if n_prompt else 0.0
    green, red = SERIES_COLORS["prefill_saved"], SERIES_COLORS["prefill_computed"]
    muted = theme.muted
    parts = [
        f"<div style='font-size:11pt'><b>{matched:,}</b> of <b>{n_prompt:,}</b> prompt tokens "
        f"would come from the cache <span style='color:{muted}'>({pages} page{'s' if pages != 1 else ''}, "
        f"{pct:.0f}%)</span></div>",
        _bar(pct, green, red),
        f"<div style='margin-top:6px'><span style='color:{muted}'>The match stops:</span> "
        f"<b>{html.escape(short)}</b> — {html.escape(words)}.</div>",
    ]
    if info.get("parts"):  # the scheduler's own accounting: why each token would or would not hit
        words = ", ".join(f"<span style='color:{PART_COLORS[k]}'>■</span> {html.escape(k)} <b>{n:,}</b>"
                          for k, n in segments(info["parts"]))
        parts.append(f"<div style='margin-top:6px'><span style='color:{muted}'>Where its tokens would go:"
                     f"</span> {words}</div>")
        if info.get("evicted_by"):
            parts.append(f"<div><span style='color:{muted}'>Its cached pages were</span> "
                         f"{html.escape(str(info['evicted_by']))}</div>")
    chain = info.get("chain_id")
    if chain is not None:
        parts.append(f"<div><span style='color:{muted}'>Nearest cached chain:</span> "
                     f"<b>#{html.escape(str(chain))}</b></div>")
    diff = info.get("first_diff_index")
    if diff is None:
        parts.append(f"<div style='margin-top:6px;color:{muted}'>No differing token: every prompt token "
                     f"checked is in the cache.</div>")
    else:
        before = visible_text(str(info.get("context_before") or ""))
        prompt_tok = info.get("prompt_token")
        cached_tok = info.get("cached_token")
        mono = "font-family:monospace;white-space:pre-wrap"
        p_html = (f"<span style='background:{theme.prompt_bg};font-weight:bold'>"
                  f"{visible_text(str(prompt_tok), spaces=True)}</span>" if prompt_tok is not None
                  else f"<i style='color:{muted}'>(end of prompt)</i>")
        c_html = (f"<span style='background:{theme.cached_bg};font-weight:bold'>"
                  f"{visible_text(str(cached_tok), spaces=True)}</span>" if cached_tok is not None
                  else f"<i style='color:{muted}'>(nothing cached here)</i>")
        parts.append(
            f"<div style='margin-top:6px'><span style='color:{muted}'>First difference at token</span> "
            f"<b>{int(diff):,}</b></div>"
            f"<table cellspacing='0' cellpadding='2' style='margin-top:2px'>"
            f"<tr><td style='color:{muted};padding-right:6px'>prompt</td>"
            f"<td style='{mono}'>…{before}{p_html}</td></tr>"
            f"<tr><td style='color:{muted};padding-right:6px'>cache</td>"
            f"<td style='{mono}'>…{before}{c_html}</td></tr></table>")
    return "".join(parts)


def _bar(pct: float, done: str, rest: str) -> str:
    """A thin two-colour bar as a rich-text table (QLabel has no CSS widths)."""
    pct = max(0.0, min(100.0, pct))
    cells = []
    if pct > 0:
        cells.append(f"<td width='{pct:.1f}%' bgcolor='{done}'></td>")
    if pct < 100:
        cells.append(f"<td width='{100 - pct:.1f}%' bgcolor='{rest}'></td>")
    return ("<table width='100%' cellspacing='0' cellpadding='0' style='margin-top:4px;font-size:3pt'>"
            f"<tr>{''.join(cells)}</tr></table>")


class ProbeView(QFrame):
    """Shows one probe of the cache ('why it missed') as rich text."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("probeView")
        self.setFrameShape(QFrame.Shape.NoFrame)
        self._info: dict | None = None
        self._html = ""
        self.label = QLabel(self)
        self.label.setTextFormat(Qt.TextFormat.RichText)
        self.label.setWordWrap(True)
        self.label.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.label.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        self.label.setContentsMargins(2, 2, 2, 2)
        scroll = QScrollArea(self)  # a long context never gets cut off: it scrolls
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setWidgetResizable(True)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        scroll.setWidget(self.label)
        scroll.viewport().setAutoFillBackground(False)
        self.label.setAutoFillBackground(False)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(scroll)
        self.setMinimumHeight(120)
        self.clear()

    def show_probe(self, info: dict) -> None:
        """Render a probe: matched_tokens, matched_pages, n_prompt, stop_reason, first_diff_index,
        chain_id, context_before, prompt_token, cached_token."""
        self._info = dict(info)
        self._render()

    def clear(self) -> None:
        self._info = None
        self._render()

    def html(self) -> str:
        """The rich text shown now."""
        return self._html

    def plain_text(self) -> str:
        """What the reader sees, without markup."""
        from PySide6.QtGui import QTextDocument
        doc = QTextDocument()
        doc.setHtml(self._html)
        return doc.toPlainText()

    def _render(self) -> None:
        theme = theme_for(self)
        if self._info is None:
            self._html = f"<span style='color:{theme.muted}'>{EMPTY_TEXT}</span>"
        else:
            self._html = probe_html(self._info, theme)
        self.label.setText(self._html)

    def changeEvent(self, e: QEvent) -> None:  # noqa: N802 - Qt's name
        if e.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange) \
                and hasattr(self, "label"):
            self._render()
        super().changeEvent(e)
