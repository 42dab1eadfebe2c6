"""Screenshots for the docs, at 1280x800: W8 running (eight cards, light), the page map of the
default KV budget's pool with a page hovered (dark), the Advisor tab after "Try the example".

    python tools/screenshot.py [--out docs] [--scenario W8] [--max-new-tokens N]
    python tools/screenshot.py --tour [--out docs]   # the first start's tour
    python tools/screenshot.py [--tour] --theme dark --out docs/shots   # every shot in one theme

Runs offscreen unless DISPLAY is set (then under X, e.g. Xvfb). Uses a throw-away
QSettings folder, so your own settings and session are left alone. Also prints how
long the UI thread's event loop was ever blocked while the streams generated.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if not os.environ.get("DISPLAY"):
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import engine  # noqa: E402

engine.tune_process()  # before NumPy loads OpenBLAS

from PySide6.QtCore import QCoreApplication, QElapsedTimer, QSettings, QTimer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "docs"))
    parser.add_argument("--scenario", default="W8")
    parser.add_argument("--max-new-tokens", type=int, default=0, help="0: the scenario's own")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--tour", action="store_true", help="grab the guided tour's steps instead")
    parser.add_argument("--theme", choices=("light", "dark"),
                        help="every shot in this theme, its name ending -THEME (default: the docs' mix)")
    args = parser.parse_args(argv)
    global THEME
    THEME = args.theme
    if args.tour:
        return tour_shots(args.out, args.timeout)

    app, desktop = open_desktop()
    from app.desktop.settings import AppSettings
    from app.scenario import bundled_scenarios

    window, control = desktop.window, desktop.controller

    def wait(pred, what: str) -> float:
        return wait_until(app, pred, what, args.timeout)

    print(f"model loaded in {wait(lambda: control.model_info is not None, 'the model'):.1f} s")
    scenario = next(s for s in bundled_scenarios() if args.scenario.lower() in s.name.lower())
    desktop.load_scenario(scenario)
    if args.max_new_tokens:
        control.apply_settings(AppSettings.from_dict({**control.settings.to_dict(),
                                                      "max_new_tokens": args.max_new_tokens}))

    # Event-loop latency: a 10 ms timer notes the longest gap between its ticks.
    clock, gaps = QElapsedTimer(), []
    clock.start()

    def tick():
        gaps.append(clock.restart())

    ticker = QTimer()
    ticker.setInterval(10)
    ticker.timeout.connect(tick)
    ticker.start()
    n = desktop.run_all()
    os.makedirs(args.out, exist_ok=True)
    running = os.path.join(args.out, "screenshot-light.png")  # mid-run: eight cards streaming
    secs = wait(lambda: sum(len(c.answer_text()) > 120 for c in window.streams.cards.values()) >= n
                or not control.running, "answers under way")
    settle(app)
    window.charts.refresh()
    shot(window, running)
    secs += wait(lambda: len(control.finished_records) >= n and not control.running, "the run")
    ticker.stop()
    tokens = sum(r.n_gen for r in control.finished_records)
    gaps = sorted(gaps[1:]) or [0]
    print(f"{n} streams, {tokens} tokens in {secs:.1f} s ({tokens / secs:.1f} tok/s overall); "
          f"UI event loop: median gap {gaps[len(gaps) // 2]} ms, worst {gaps[-1]} ms")

    # "Why it missed" for a prompt not run yet: it shares the system prompt, then differs.
    window.prompt_list.add_prompt("Do you sell hammers?")
    desktop.probe_selected()
    wait(lambda: control.last_probe is not None, "the probe")
    wait(lambda: control.snapshot is not None, "a snapshot")
    settle(app)

    dark, advisor = cache_and_advisor_shots(app, desktop, args.out, wait)
    print(f"wrote {running}, {dark} and {advisor}")
    window.close()
    return 0 if control.last_error is None else 1


def cache_and_advisor_shots(app, desktop, out: str, wait) -> tuple[str, str]:
    """The Cache tab in the dark theme with a page in use hovered, then the Advisor tab after
    Try the example (light); returns the two paths."""
    window = desktop.window
    window.streams.setFocus()
    window.set_theme(THEME or "dark")
    window.tabs.setCurrentWidget(window.cache_panel)
    settle(app)
    page_map = window.cache_panel.page_map
    used = [p for p in page_map.shown_pages() if page_map.tooltip_for(p) and "free" not in
            page_map.tooltip_for(p).split("state")[1][:40]]
    if used:  # hover a page in use: its tooltip, as a person pointing at it sees it
        from PySide6.QtCore import QEvent
        from PySide6.QtGui import QHelpEvent
        pos = page_map.cell_rect(used[0]).center()
        app.sendEvent(page_map, QHelpEvent(QEvent.Type.ToolTip, pos, page_map.mapToGlobal(pos)))
        settle(app)
    dark = os.path.join(out, "screenshot-dark.png")
    shot(window, dark)
    window.set_theme(THEME or "light")
    window.tabs.setCurrentWidget(window.advisor)
    window.advisor.example_button.click()
    wait(lambda: desktop.advisor.advice is not None and not desktop.advisor.busy, "the advice")
    settle(app)
    advisor = os.path.join(out, "screenshot-advisor.png")
    shot(window, advisor)
    return dark, advisor


def tour_shots(out: str, timeout: float) -> int:
    """The tour as a first start shows it, at 1280x800: B attaching (Cache tab), B's tail (Charts)."""
    app, desktop = open_desktop(size=(1280, 800))
    from app.desktop.tour import start_tour

    tour, shown = start_tour(desktop), []
    tour.step_shown.connect(shown.append)
    files = {"attach_b": "screenshot-tour.png", "prefill_b": "screenshot-tour-ttft.png"}
    os.makedirs(out, exist_ok=True)
    wait_until(app, lambda: shown, "the tour's first step", timeout)
    while shown[-1] != "teardown":
        n = len(shown)
        tour.panel.next_button.click()
        wait_until(app, lambda n=n: len(shown) > n, "the next step", timeout)
        if shown[-1] in files:
            settle(app)
            desktop.window.charts.refresh()
            path = os.path.join(out, files[shown[-1]])
            shot(desktop.window, path)
            print(f"wrote {path}: {tour.panel.caption.text()}")
    desktop.window.close()
    return 0 if desktop.controller.last_error is None else 1


THEME: str | None = None  # --theme: every shot in it, named -THEME


def shot(window, path: str) -> None:
    """The window as a person sees it: under X (Xvfb) the screen itself, tooltips included, with
    ImageMagick's `import`; offscreen, the window's own drawing."""
    import shutil
    import subprocess
    if THEME:
        window.set_theme(THEME)
        settle(QCoreApplication.instance())
        path = path.replace(".png", f"-{THEME}.png")
    if os.environ.get("DISPLAY") and shutil.which("import"):
        g = window.frameGeometry()
        subprocess.run(["import", "-window", "root", "-crop", f"{g.width()}x{g.height()}+{g.x()}+{g.y()}",
                        path], check=True, timeout=60)
    else:
        window.grab().save(path)


def open_desktop(size: tuple[int, int] = (1280, 800)):
    """The app on throw-away settings, light theme, its window shown at `size`: (app, desktop)."""
    QSettings.setPath(QSettings.Format.IniFormat, QSettings.Scope.UserScope, tempfile.mkdtemp())
    from app.desktop.gui import make_app
    from app.desktop.window import Desktop
    from ui.theme import apply_theme

    app = make_app([sys.argv[0]])
    apply_theme(app, "light")
    desktop = Desktop()
    desktop.window.resize(*size)
    desktop.window.show()
    return app, desktop


def wait_until(app, pred, what: str, timeout: float) -> float:
    """Run the event loop until pred() holds; seconds it took (TimeoutError naming `what` after `timeout`)."""
    t0 = time.perf_counter()
    while not pred():
        app.processEvents()
        time.sleep(0.005)
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"timed out waiting for {what}")
    return time.perf_counter() - t0


def settle(app, seconds: float = 0.4) -> None:
    """Let timers (chart refresh, stream flush) and repaints run."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        app.processEvents()
        time.sleep(0.01)


if __name__ == "__main__":
    sys.exit(main())
