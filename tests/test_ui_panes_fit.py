"""Every pane fits the window: at 1280x800 and 1600x1000, in both themes, no stream card, badge,
table or panel control lies (partly) outside the pane that shows it. Cards narrower than their
contents were how this failed: answers cut mid-word at the column's edge, "TTFT 880 r"."""

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402
from PySide6.QtCore import QRect, QSettings, Qt  # noqa: E402
from PySide6.QtWidgets import QAbstractScrollArea, QWidget  # noqa: E402

from app.desktop.transcript import Transcript  # noqa: E402
from ui.stream_view import _set_badge  # noqa: E402

ANSWER = "We do a lot of things with the help of the people around us, and that is how it goes. " * 3


def _rect_in(widget: QWidget, ancestor: QWidget) -> QRect:
    return QRect(widget.mapTo(ancestor, widget.rect().topLeft()), widget.size())


def cut_children(pane: QWidget) -> list[str]:
    """The visible widgets under `pane` that extend past its rect. A scroll area's contents are
    judged against its viewport, since that is what a person sees of them."""
    bad = []

    def walk(parent: QWidget, frame: QWidget) -> None:
        for child in parent.findChildren(QWidget, options=Qt.FindChildOption.FindDirectChildrenOnly):
            if not child.isVisible() or child.isWindow():
                continue
            r = _rect_in(child, frame)
            if not frame.rect().contains(r):
                name = child.objectName() or (child.text() if hasattr(child, "text") else "")
                bad.append(f"{type(child).__name__} {name!r} at {r.getRect()} outside {frame.rect().getRect()}")  # noqa: E501
            if isinstance(child, QAbstractScrollArea):
                inner = child.viewport()
                walk(inner, inner)
            else:
                walk(child, frame)

    walk(pane, pane)
    return bad


@pytest.fixture
def main_window(qtbot, tmp_path):
    from ui.main_window import MainWindow

    w = MainWindow(QSettings(str(tmp_path / "w.ini"), QSettings.Format.IniFormat))
    qtbot.addWidget(w)
    for i in range(8):  # W8: eight cards with every badge shown
        t = Transcript(f"p{i + 1}", "What do you do for a living and why does it matter?")
        t.start_conversation(f"c{i}", "system")
        t.begin_turn("What do you do for a living and why does it matter to you?")
        card = w.add_card(t)
        card.show_turn_started()
        t.n_prompt, t.request_id = 112, i
        card.show_accepted()
        card.show_text(ANSWER)
        card._cache_badge(96, 112)
        _set_badge(card.badge_ttft, "TTFT 880 ms")
        _set_badge(card.badge_tps, "35.2 tok/s")
        _set_badge(card.badge_reason, "length", "length")
    return w


@pytest.mark.parametrize("size", [(1280, 800), (1600, 1000)])
@pytest.mark.parametrize("theme", ["light", "dark"])
def test_every_pane_fits(main_window, qtbot, theme, size):
    w = main_window
    w.set_theme(theme)
    w.show()
    qtbot.waitExposed(w)
    w.reset_layout()  # the default splits, then the screen's size
    w.resize(*size)
    qtbot.wait(50)
    assert (w.width(), w.height()) == size, "the window's minimum is wider than the screen"
    grid = w.streams
    for card in grid.cards.values():
        assert _rect_in(card, grid.viewport()).right() < grid.viewport().width(), card.uid  # no column cut
        assert not cut_children(card), (card.uid, cut_children(card))
    assert not cut_children(w.prompt_pane)
    for i in range(w.tabs.count()):
        w.tabs.setCurrentIndex(i)
        qtbot.wait(20)
        page = w.tabs.widget(i)
        assert not cut_children(page), (w.tabs.tabText(i), cut_children(page))
