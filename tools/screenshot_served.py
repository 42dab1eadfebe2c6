"""Screenshots of served traffic for the docs: HTTP clients against the app's Server toggle.

    python tools/screenshot_served.py [--out docs] [--max-tokens N]

Turns the server on, sends the W8 questions from 8 concurrent streaming clients, then two
requests whose system prompts start with different timestamps, and grabs the window on the
Cache tab and on the Served tab. Offscreen unless DISPLAY is set; throw-away settings.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if not os.environ.get("DISPLAY"):
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import engine  # noqa: E402

engine.tune_process()  # before NumPy loads OpenBLAS

from tools.screenshot import open_desktop, settle  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "docs"))
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)

    app, desktop = open_desktop()
    from app.bench.serve import W8, free_port
    from app.desktop.settings import AppSettings
    from app.scenario import load_scenario
    from app.serve import loadtest

    window, control = desktop.window, desktop.controller
    while control.model_info is None:
        settle(app, 0.1)
    control.apply_settings(AppSettings.from_dict({**control.settings.to_dict(), "server_port": free_port()}))
    window.act_server.trigger()
    base = desktop.server.base_url
    sc = load_scenario(W8)
    done = threading.Event()

    def clients() -> None:
        loadtest.run_clients(base, sc.system, sc.prompts, args.max_tokens)
        for minute in ("41", "42"):
            system = f"Now: 2026-11-30T22:{minute}. " + sc.system
            loadtest.run_clients(base, system, ["Are you open today?"], 8)
        done.set()

    threading.Thread(target=clients, daemon=True).start()
    while not done.is_set() or control.running:
        settle(app, 0.1)
    settle(app)
    os.makedirs(args.out, exist_ok=True)
    paths = []
    for pane, name in ((window.cache_panel, "screenshot-served.png"),
                       (window.served_view, "screenshot-served-friendliness.png")):
        window.tabs.setCurrentWidget(pane)
        settle(app)
        paths.append(os.path.join(args.out, name))
        window.grab().save(paths[-1])
    print("wrote " + " and ".join(paths))
    window.close()
    return 0 if control.last_error is None else 1


if __name__ == "__main__":
    sys.exit(main())
