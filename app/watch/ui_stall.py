"""The watch window's longest UI stall while a feed runs at a set rate (run as a child process).

`python -m app.watch.ui_stall [--seconds S] [--rate EVENTS_PER_S]` opens the real
"Watch a server" window (offscreen unless a display is set), feeds it vLLM-shaped
batches from a PUB socket at the given block-event rate, and prints JSON: the
longest gap between ticks of a 10 ms heartbeat timer on the UI thread.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time

HEARTBEAT_MS = 10


def measure(seconds: float = 3.0, rate: float = 5000.0) -> dict:
    """Run the window against a feed of `rate` block events per second for `seconds`."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    import zmq
    from PySide6.QtCore import QEventLoop, QSettings, QTimer
    from PySide6.QtWidgets import QApplication

    from app.kv_wire import seq_bytes

    from .gui import WatchWindow
    from .throughput import BLOCK_EVENTS_PER_BATCH, vllm_like_batches

    _app = QApplication.instance() or QApplication([])  # noqa: F841 - must outlive the window
    n_batches = max(1, int(seconds * rate / BLOCK_EVENTS_PER_BATCH))
    payloads = vllm_like_batches(n_batches)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.bind("tcp://127.0.0.1:*")
    with tempfile.TemporaryDirectory() as tmp:
        store = QSettings(os.path.join(tmp, "watch.ini"), QSettings.Format.IniFormat)
        window = WatchWindow(store=store)
        window.show()
        if not window.start_watching([pub.getsockopt_string(zmq.LAST_ENDPOINT)], [], ""):
            raise RuntimeError(window.view.status.text())
        if not pub.poll(10_000):
            raise RuntimeError("the watch window never subscribed")
        pub.recv()
        gaps: list[float] = []
        last = [time.perf_counter()]

        def beat() -> None:
            now = time.perf_counter()
            gaps.append(now - last[0])
            last[0] = now

        def send() -> None:
            t0 = time.perf_counter()
            for i, payload in enumerate(payloads):
                delay = t0 + i * BLOCK_EVENTS_PER_BATCH / rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                pub.send_multipart([b"", seq_bytes(i), payload])

        def run_loop(ms: int) -> None:
            loop = QEventLoop()
            QTimer.singleShot(ms, loop.quit)
            loop.exec()

        timer = QTimer()
        timer.setInterval(HEARTBEAT_MS)
        timer.timeout.connect(beat)
        timer.start()
        run_loop(1000)  # the idle baseline: what the machine's load alone costs the UI thread
        idle, gaps[:] = sorted(gaps), []
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        run_loop(int(1000 * (seconds + 1.0)))  # a second more for the last snapshots
        sender.join()
        timer.stop()
        summary = window.session.take_snapshot().engines[0].summary if window.session else {}
        window.close()
    pub.close(0)
    ctx.term()
    stalls = sorted(gaps)
    return {"rate_events_per_s": rate, "seconds": seconds, "heartbeat_ms": HEARTBEAT_MS,
            "max_stall_ms": 1000 * stalls[-1] if stalls else None,
            "p99_gap_ms": 1000 * stalls[int(0.99 * (len(stalls) - 1))] if stalls else None,
            "idle_max_stall_ms": 1000 * idle[-1] if idle else None,
            "batches_applied": summary.get("batches"), "batches_sent": n_batches,
            "block_events_applied": summary.get("stored_blocks", 0) + summary.get("removed_blocks", 0)}


def main() -> None:
    """Print the measurement as one JSON line."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rate", type=float, default=5000.0)
    args = p.parse_args()
    print(json.dumps(measure(args.seconds, args.rate)))


if __name__ == "__main__":
    main()
