"""Screenshot of File → Watch a server with two engines side by side, for the README.

    python tools/watch_screenshot.py [--out docs/screenshot-watch.png]

Two real schedulers on the bundled model, each publishing its cache as KV events on
127.0.0.1 (as `prefixlab serve --kv-events` does), answer questions that share one
system prompt; the watch window subscribes to both and is grabbed offscreen.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if not os.environ.get("DISPLAY"):
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import engine  # noqa: E402

engine.tune_process()  # before NumPy loads OpenBLAS

from PySide6.QtCore import QSettings  # noqa: E402

from tools.screenshot import settle  # noqa: E402

SYSTEM = ("You are the assistant of Bolt & Board, a neighbourhood hardware store. We sell power drills, "
          "hand saws, screws, nails, paint and ladders. Answer in one short sentence.")
QUESTIONS = [["Do you sell drills?", "Do you have green paint?", "Can I buy a ladder here?"],
             ["Are nails sold by weight?", "Do you sell drills?", "Which saw cuts metal?",
              "Do you rent ladders?"]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "screenshot-watch.png"))
    args = p.parse_args(argv)
    QSettings.setPath(QSettings.Format.IniFormat, QSettings.Scope.UserScope, tempfile.mkdtemp())
    from app.desktop.gui import make_app
    from app.serve.kv_events_publisher import KVEventPublisher
    from app.watch.gui import WatchWindow
    from engine import SamplingParams, load_model
    from engine.loop import EngineLoop
    from engine.scheduler import SchedulerSettings
    from ui.theme import apply_theme

    app = make_app([sys.argv[0]])
    apply_theme(app, "light")
    model = load_model()
    engines = []
    for _ in QUESTIONS:
        loop = EngineLoop(model, SchedulerSettings(max_streams=4, page_rows=16))
        publisher = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        engines.append((loop, publisher.attach(loop.scheduler.cache)))
    window = WatchWindow()
    window.resize(1500, 900)
    window.show()
    window.start_watching([pub.endpoint for _, pub in engines],
                          [pub.replay_endpoint for _, pub in engines], "")
    for (loop, pub), questions in zip(engines, QUESTIONS):
        pub.wait_for_subscriber(10)
        for q in questions:
            loop.submit_now(system=SYSTEM, user=q, sampling=SamplingParams(temperature=0.0),
                            max_new_tokens=12)
        while loop.has_work():
            loop.step()
            app.processEvents()
        pub.flush(10)
    settle(app, 3.0)
    window.grab().save(args.out)
    print(f"wrote {args.out}")
    window.close()
    for _, pub in engines:
        pub.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
