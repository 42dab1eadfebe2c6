"""The app's Server toggle: HTTP requests run on the desktop engine's own scheduler, beside typed prompts."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import httpx  # noqa: E402
import pytest  # noqa: E402

from app.desktop.desktop_engine import ModelLoaded, Served  # noqa: E402
from app.desktop.engine_driver import EngineDriver  # noqa: E402
from app.desktop.settings import AppSettings  # noqa: E402
from app.serve.desktop import DesktopServer  # noqa: E402
from engine import SamplingParams  # noqa: E402
from engine.scheduler import FinishEvent  # noqa: E402

SYSTEM = "You help at a hardware store that sells drills, saws, screws and paint."


@pytest.fixture
def driver(qtbot, tiny_gguf_path):
    c = EngineDriver()
    try:
        # Signals of the engine's thread land in lists (waitSignal's timer may only stop in ours).
        c.reports, c.events = [], []
        c.reported.connect(c.reports.append)
        c.job_events.connect(c.events.extend)
        c.apply_settings(AppSettings(page_rows=4, max_streams=4))
        c.load_model(tiny_gguf_path)
        qtbot.waitUntil(lambda: any(isinstance(r, ModelLoaded) for r in c.reports), timeout=60_000)
        yield c
    finally:
        c.shutdown()


def test_http_requests_run_on_the_apps_scheduler_and_reach_the_window(qtbot, driver):
    server = DesktopServer(driver)
    url = server.start(port=0)
    def finished() -> dict:  # ticket -> its finish record
        return {ticket: ev.record for ticket, ev in driver.events if isinstance(ev, FinishEvent)}

    try:
        # A typed prompt first: its pages are in the scheduler the HTTP request then uses.
        typed = driver.submit({"system": SYSTEM, "user": "Do you sell drills?",
                               "max_new_tokens": 4, "sampling": SamplingParams(temperature=0.0)})
        qtbot.waitUntil(lambda: len(finished()) == 1, timeout=60_000)
        first = finished()[typed]
        assert first.preview == "Do you sell drills?" and first.finish_reason == "length"
        body = {"model": "gpt-4o", "user": "bob", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Paint?"}]}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the typed prompt's pages
        qtbot.waitUntil(lambda: len(finished()) == 2)
    finally:
        server.stop()
    (ticket, served), = [(t, ev) for t, ev in driver.events if isinstance(ev, Served)]
    assert served.client == "http 127.0.0.1 model=gpt-4o user=bob" and served.preview == "Paint?"
    record = finished()[ticket]  # the served job's finish comes under the same ticket
    assert record.id == served.request_id and ticket != typed
    assert record.client == served.client and record.n_cached > 0 and record.n_prompt == served.n_prompt
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)  # the toggle is off: nothing listens
