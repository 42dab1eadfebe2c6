"""Start the desktop app: `prefixlab` with no subcommand calls `run_app`."""

from __future__ import annotations

import signal
import sys

from .settings import APPLICATION, ORGANIZATION, qsettings


def make_app(argv: list[str] | None = None):
    """The QApplication (made once), named and themed from the remembered settings."""
    from PySide6.QtWidgets import QApplication

    from ui.theme import apply_theme, icon
    from ui.window_state import THEME_KEY

    app = QApplication.instance() or QApplication(argv if argv is not None else sys.argv)
    app.setOrganizationName(ORGANIZATION)
    app.setApplicationName(APPLICATION)
    app.setApplicationDisplayName("PrefixLab")
    app.setWindowIcon(icon("prefixlab"))
    apply_theme(app, str(qsettings().value(THEME_KEY, "light")))
    return app


def run_app(model_path: str | None) -> int:
    """Open the main window, load `model_path` (None: the bundled model) in the background, run."""
    from .qt_libs import startup_problem

    # Qt aborts the process when its platform plugin cannot load, with words that do not
    # name the library: look first, and say the fix.
    problem = startup_problem()
    if problem:
        print(f"prefixlab: {problem}", file=sys.stderr)
        return 2
    from PySide6.QtCore import QTimer

    app = make_app()
    from .tour import maybe_start_tour
    from .window import Desktop

    desktop = Desktop(model_path=model_path)
    window = desktop.window
    window.show()
    maybe_start_tour(desktop)
    # Ctrl+C in the terminal closes the window cleanly: Python only sees signals when the
    # interpreter runs, so a slow timer gives it the chance.
    signal.signal(signal.SIGINT, lambda *_: window.close())
    tick = QTimer()
    tick.timeout.connect(lambda: None)
    tick.start(250)
    code = app.exec()
    desktop.shutdown()
    return code
