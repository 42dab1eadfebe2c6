"""The "Watch a server" window on real sockets and real widgets (offscreen)."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from app.desktop.settings import qsettings  # noqa: E402
from app.serve.kv_events_publisher import KVEventPublisher  # noqa: E402
from app.watch.gui import WatchWindow  # noqa: E402
from tests.kv_events_helpers import Event, Page  # noqa: E402


def test_watch_window_shows_two_engines_side_by_side_and_remembers_them(qtbot, gui_settings):
    pubs = [KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") for _ in range(2)]
    window = WatchWindow()
    qtbot.addWidget(window)
    try:
        assert window.start_watching([p.endpoint for p in pubs], [p.replay_endpoint for p in pubs], "")
        system = (Page(1, None, (1, 2)), Page(2, 1, (3, 4)))
        for i, p in enumerate(pubs):
            assert p.wait_for_subscriber(10)
            p(Event("stored", system + (Page(10 + i, 2, (5 + i, 6)),)))
        qtbot.waitUntil(lambda: len(window.view.panes) == 2 and all(
            "live 3 blocks" in pane.counters.text() for pane in window.view.panes), timeout=10_000)
        pane = window.view.panes[0]
        assert pubs[0].endpoint in pane.title.text()
        assert pane.chains.rowCount() == 1 and pane.chains.item(0, 1).text() == "3"
        assert list(pane.block_map.cells) == [0, 0, 0]  # three blocks of chain 0 in the block map
        assert "2 blocks cached on several engines" in window.view.cross.text()
        window.stop_watching()
        assert window.view.connect_button.text() == "Connect"
    finally:
        window.close()
        for p in pubs:
            p.close()
    again = WatchWindow(store=qsettings())
    qtbot.addWidget(again)
    assert again.view.endpoints.text().split() == [p.endpoint for p in pubs]


def test_watch_window_names_a_bad_endpoint(qtbot, gui_settings):
    window = WatchWindow()
    qtbot.addWidget(window)
    assert not window.start_watching(["not-an-endpoint"], [], "")
    assert "Cannot watch" in window.view.status.text() and "not-an-endpoint" in window.view.status.text()


def test_file_menu_opens_the_watch_window(qtbot, gui_settings):
    from PySide6.QtWidgets import QMainWindow

    from app.watch.gui import WatchWindow, install_watch_action
    main = QMainWindow()
    qtbot.addWidget(main)
    file_menu = main.menuBar().addMenu("&File")
    file_menu.addAction("&Open model…")
    file_menu.addAction("&Quit")
    act = install_watch_action(main)
    assert [a.text() for a in file_menu.actions()] == ["&Open model…", "&Watch a server…", "&Quit"]
    act.trigger()
    (first,) = main.findChildren(WatchWindow)
    assert first.isVisible() and first.isWindow() and first.parent() is main
    act.trigger()  # once open, the same window comes back to the front
    assert main.findChildren(WatchWindow) == [first]
    first.close()


def test_the_apps_file_menu_has_watch_a_server(qtbot, gui_settings):
    from app.desktop.window import Desktop
    desk = Desktop(autoload=False)
    qtbot.addWidget(desk.window)
    file_menu = next(a.menu() for a in desk.window.menuBar().actions() if a.text() == "&File")
    (act,) = [a for a in file_menu.actions() if a.text() == "&Watch a server…"]
    act.trigger()
    from app.watch.gui import WatchWindow
    (win,) = desk.window.findChildren(WatchWindow)
    assert win.isVisible()
    desk.window.close()
