"""The window's Server toggle: an HTTP request becomes a card labelled with its client, and enters
the chains table and the Served tab; the status bar shows the address."""

from __future__ import annotations

import os
import socket
import threading

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import httpx  # noqa: E402
import pytest  # noqa: E402

from app.bench.serve import free_port  # noqa: E402
from tests.gui_helpers import LOAD_TIMEOUT_MS, SYSTEM, Errors, close_boxes, set_settings  # noqa: E402

LABEL = "http 127.0.0.1 model=gpt-4o user=bob"


@pytest.fixture
def desktop(open_desktop, qtbot, tiny_gguf_path):
    d = open_desktop(autoload=True, model_path=tiny_gguf_path)
    d.window.show()
    d.errors = Errors(d.controller)
    qtbot.waitUntil(lambda: d.controller.model_info is not None, timeout=LOAD_TIMEOUT_MS)
    return d


def test_an_http_request_appears_as_a_card_and_in_the_chains_table(desktop, qtbot, tmp_path):
    d, w, c = desktop, desktop.window, desktop.controller
    port = free_port()
    set_settings(d, server_port=port, max_new_tokens=4)
    w.act_server.trigger()
    base = f"http://127.0.0.1:{port}/v1"
    assert w.act_server.isChecked() and w.server_label.text() == f"serving {base}"

    body = {"model": "gpt-4o", "user": "bob", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Any paint?"}]}
    r = httpx.post(base + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]

    qtbot.waitUntil(lambda: len(c.finished_records) == 1 and not c.running, timeout=30_000)
    uid = next(u for u in c.transcripts if u.startswith("http-"))
    card = w.streams.card(uid)
    assert card.title.text() == f"{LABEL}: Any paint?"
    assert card.answer_text() == answer and card.turns[-1].reason == "length"
    assert c.finished_records[0].client == LABEL
    # The request donated its prompt's pages: its chain is in the cache panel.
    w.tabs.setCurrentWidget(w.cache_panel)  # a hidden tab draws only once shown
    chains = w.cache_panel.chains_table.chains_model
    qtbot.waitUntil(lambda: chains.rowCount() > 0, timeout=10_000)
    assert any(chains.chain_at(i).preview == "Any paint?" for i in range(chains.rowCount()))
    assert w.served_view.item(0, 0).text() == LABEL and w.served_view.item(0, 1).text() == "1"
    assert w.requests_table.item(0, w.requests_table.columnCount() - 1).text() == LABEL
    # ... and in the exported report.
    c.export_report(str(tmp_path / "report.html"), "")
    qtbot.waitUntil(lambda: bool(c.last_report_paths), timeout=30_000)
    assert LABEL in (tmp_path / "report.html").read_text("utf-8")

    w.act_server.trigger()
    assert not w.act_server.isChecked() and w.server_label.text() == ""
    with pytest.raises(httpx.ConnectError):
        httpx.get(base + "/models", timeout=2)
    assert not d.errors


def serve_a_long_streamed_answer(d) -> tuple[threading.Thread, list[str]]:
    """Turn the server on and start a client thread streaming a long answer; its SSE lines fill in."""
    set_settings(d, server_port=free_port())
    d.window.act_server.trigger()
    body = {"max_tokens": 400, "stream": True, "messages": [{"role": "user", "content": "Tell me a story."}]}
    lines: list[str] = []

    def client() -> None:
        with httpx.stream("POST", d.server.base_url + "/chat/completions", json=body, timeout=60) as r:
            lines.extend(r.iter_lines())

    thread = threading.Thread(target=client)
    thread.start()
    return thread, lines


def test_a_served_cards_stop_ends_its_clients_stream_and_a_new_port_restarts(desktop, qtbot):
    d, w, c = desktop, desktop.window, desktop.controller
    thread, lines = serve_a_long_streamed_answer(d)
    qtbot.waitUntil(lambda: any(u.startswith("http-") for u in c.transcripts), timeout=30_000)
    card = w.streams.card(next(u for u in c.transcripts if u.startswith("http-")))
    qtbot.waitUntil(lambda: bool(card.answer_text()), timeout=30_000)
    card.stop_button.click()
    qtbot.waitUntil(lambda: not thread.is_alive() and not c.running, timeout=30_000)
    assert card.turns[-1].reason == "cancelled"
    assert lines[-2:] == ["data: [DONE]", ""] and any('"finish_reason": "stop"' in x for x in lines)

    port = free_port()
    set_settings(d, server_port=port)  # serving: the new port takes over at once
    assert w.server_label.text() == f"serving http://127.0.0.1:{port}/v1"
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    w.act_server.trigger()


def test_a_port_in_use_is_an_error_and_the_toggle_stays_off(desktop, qtbot):
    d, w = desktop, desktop.window
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        set_settings(d, server_port=taken.getsockname()[1])
        w.act_server.trigger()
    assert not w.act_server.isChecked() and w.server_label.text() == ""
    assert d.errors and "the port is in use" in d.errors[-1]
    close_boxes(w)


def test_quitting_while_serving_ends_open_streams_cleanly(desktop, qtbot):
    d, w, c = desktop, desktop.window, desktop.controller
    thread, lines = serve_a_long_streamed_answer(d)
    qtbot.waitUntil(lambda: any(c.transcripts[u].turns and c.transcripts[u].pieces
                                for u in c.transcripts if u.startswith("http-")), timeout=30_000)
    w.close()  # the app quits: the stream ends with its finish chunk, then the connection closes
    thread.join(30)
    assert not thread.is_alive() and lines[-2:] == ["data: [DONE]", ""]
