"""The What-if tab's screenshot for the docs: the app's window, the shipped Mooncake trace swept.

    python tools/whatif_screenshot.py [--out docs/whatif.png] [--timeout S]
        [--head N --budgets "inf, 300, 100" --cost FILE.json --slo-ttft S]

Opens the desktop app (no model needed), loads the trace into the What-if tab the way
its "Load trace…" button does, runs four policies at six capacities (the sweep runs in
parallel processes) and grabs the window. With --cost it then presses Predict TTFT: the
twin runs the engine's scheduler for every token, far too long for the whole trace, so
give --head (its first N requests) and capacities that fit them. Offscreen unless
DISPLAY is set; a throw-away QSettings folder leaves your own settings alone.
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

from tools.screenshot import wait_until  # noqa: E402

TRACE = os.path.join(ROOT, "resources", "traces", "mooncake", "conversation_trace.jsonl")
BUDGETS = "inf, 100000, 30000, 10000, 3000, 1000"
POLICIES = ["leaf-lru", "lru", "lfu", "fifo"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "whatif.png"))
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--head", type=int, help="the trace's first N requests only")
    parser.add_argument("--budgets", default=BUDGETS, help=f"capacities in pages (default: {BUDGETS})")
    parser.add_argument("--cost", help="a step-cost file: predict TTFT with the twin after the sweep")
    parser.add_argument("--slo-ttft", default="", help="with --cost: goodput under this TTFT (s)")
    args = parser.parse_args(argv)
    trace = TRACE
    if args.head:
        trace = os.path.join(tempfile.mkdtemp(), f"first-{args.head}.jsonl")
        with open(TRACE, encoding="utf-8") as src, open(trace, "w", encoding="utf-8") as out:
            out.writelines(line for _, line in zip(range(args.head), src))

    from PySide6.QtCore import QSettings
    QSettings.setDefaultFormat(QSettings.Format.IniFormat)
    QSettings.setPath(QSettings.Format.IniFormat, QSettings.Scope.UserScope, tempfile.mkdtemp())
    from app.desktop.gui import make_app
    from app.desktop.window import Desktop
    from app.report.files import write_bytes
    from ui.page_map import png_bytes
    from ui.theme import apply_theme

    app = make_app([sys.argv[0]])
    apply_theme(app, "light")
    desktop = Desktop(autoload=False)
    window, panel = desktop.window, desktop.window.whatif
    window.resize(1600, 1000)
    window.tabs.setCurrentWidget(panel)
    window.show()
    app.processEvents()
    window.splitter.setSizes([260, 380, 960])  # after show: the window's restore sets its own

    def wait(pred, what: str) -> None:
        wait_until(app, pred, what, args.timeout)

    desktop.whatif.load_trace(trace)
    wait(lambda: panel.run_button.isEnabled() or panel.error.text(), "the trace's plan")
    panel.budgets.setText(args.budgets)
    for name, box in panel.policies.items():
        box.setChecked(name in POLICIES)
    panel.run_button.click()
    wait(lambda: panel.table.rowCount() > 0 or panel.error.text(), "the sweep")
    if panel.error.text():
        raise SystemExit(f"what-if failed: {panel.error.text()}")
    if args.cost:
        desktop.whatif.load_cost(args.cost)
        panel.slo_ttft.setText(args.slo_ttft)
        panel.predict_button.click()
        wait(lambda: panel.chart.ttft_rows or panel.error.text(), "the twin's prediction")
        if panel.error.text():
            raise SystemExit(f"the prediction failed: {panel.error.text()}")
    app.processEvents()
    write_bytes(args.out, png_bytes(window.grab()))
    print(f"wrote {args.out}")
    desktop.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
