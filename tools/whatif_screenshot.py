"""The What-if tab's screenshot for the docs: the shipped Mooncake trace, swept and drawn.

    python tools/whatif_screenshot.py [--out docs/whatif.png] [--workers N]

Replays the trace at its suggested capacities for four policies (in parallel
processes), then grabs the What-if panel offscreen with those rows.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if not os.environ.get("DISPLAY"):
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

TRACE = os.path.join(ROOT, "resources", "traces", "mooncake", "conversation_trace.jsonl")
BUDGETS = [None, 100_000, 30_000, 10_000, 3_000, 1_000]
POLICIES = ["leaf-lru", "lru", "lfu", "fifo"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "whatif.png"))
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args(argv)

    from app.replay import whatif
    from app.replay.trace import open_trace
    source = open_trace(TRACE)
    plan = whatif.plan(source)
    rows = whatif.run(source, whatif.Knobs([None], BUDGETS, POLICIES), workers=args.workers, progress=True)

    from PySide6.QtCore import QEvent, Qt
    from PySide6.QtWidgets import QApplication

    from app.report.files import write_bytes
    from ui.page_map import png_bytes
    from ui.theme import apply_theme
    from ui.whatif_panel import WhatIfPanel
    app = QApplication.instance() or QApplication([])
    apply_theme(app, "light")
    panel = WhatIfPanel()
    panel.setAttribute(Qt.WidgetAttribute.WA_DontShowOnScreen)
    panel.resize(1100, 900)
    panel.show()
    panel.set_trace(f"{os.path.relpath(TRACE, ROOT)}: Mooncake hash-id trace, {plan.requests:,} requests, "
                    f"{plan.page_rows}-token blocks; {plan.cached_pages:,} blocks cached at infinite "
                    f"capacity", page_size_applies=False)
    panel.set_knobs([None], BUDGETS, POLICIES)
    panel.set_rows(rows)
    QApplication.sendPostedEvents(None, QEvent.Type.LayoutRequest)
    app.processEvents()
    write_bytes(args.out, png_bytes(panel.grab()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
