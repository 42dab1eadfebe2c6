"""The app's Server toggle: HTTP requests run on the worker's own scheduler, beside typed prompts."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import httpx  # noqa: E402
import pytest  # noqa: E402

from app.desktop.engine_client import EngineClient  # noqa: E402
from app.desktop.settings import AppSettings  # noqa: E402
from app.serve.desktop import DesktopServer  # noqa: E402
from engine import SamplingParams  # noqa: E402

SYSTEM = "You help at a hardware store that sells drills, saws, screws and paint."


@pytest.fixture
def client(qtbot, tiny_gguf_path):
    c = EngineClient()
    try:
        # Signals of the worker's thread land in lists (waitSignal's timer may only stop in ours).
        c.loaded, c.served, c.finished = [], [], []
        c.worker.model_loaded.connect(c.loaded.append)
        c.worker.served_submitted.connect(c.served.extend)
        c.worker.request_finished.connect(c.finished.append)
        c.apply_settings(AppSettings(page_rows=4, max_streams=4))
        c.load_model(tiny_gguf_path)
        qtbot.waitUntil(lambda: bool(c.loaded), timeout=60_000)
        yield c
    finally:
        c.shutdown()


def test_http_requests_run_on_the_apps_scheduler_and_reach_the_window(qtbot, client):
    server = DesktopServer(client.worker)
    url = server.start(port=0)
    served, finished = client.served, client.finished
    try:
        # A typed prompt first: its pages are in the scheduler the HTTP request then uses.
        client.submit([{"tag": "t1", "system": SYSTEM, "user": "Do you sell drills?",
                        "max_new_tokens": 4, "sampling": SamplingParams(temperature=0.0)}])
        qtbot.waitUntil(lambda: len(finished) == 1, timeout=60_000)
        assert finished[0].preview == "Do you sell drills?" and finished[0].finish_reason == "length"
        body = {"model": "gpt-4o", "user": "bob", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Paint?"}]}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the typed prompt's pages
        qtbot.waitUntil(lambda: len(finished) == 2)
    finally:
        server.stop()
    (rid, label, preview, n_prompt), = served
    assert label == "http 127.0.0.1 model=gpt-4o user=bob" and preview == "Paint?"
    record = next(rec for rec in finished if rec.id == rid)
    assert record.client == label and record.n_cached > 0 and record.n_prompt == n_prompt
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)  # the toggle is off: nothing listens
