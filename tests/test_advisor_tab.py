"""The Advisor tab: a loaded chat log, and the proxy's traffic advised live, in real widgets."""

from __future__ import annotations

import os

import openai

from app.advise.rules import DEFAULT_RULES
from app.desktop.advisor_controller import AdvisorController
from tests.serve_helpers import scheduler_on, start_server
from tests.test_advise import timestamp_log
from tests.test_proxy import ASK
from ui.advisor_panel import HIGHLIGHT, AdvisorPanel

WAIT_MS = 60_000


def _cells(table, column: int) -> list[str]:
    return [table.item(i, column).text() for i in range(table.rowCount())]


def test_a_loaded_chat_log_shows_totals_groups_and_the_fix(qtbot, real_model, tmp_path):
    panel = AdvisorPanel()
    qtbot.addWidget(panel)
    path = timestamp_log(tmp_path)
    ctl = AdvisorController(panel, lambda: path, lambda: real_model.tokenizer)
    try:
        panel.load_button.click()  # asks for a path: the lambda answers
        qtbot.waitUntil(lambda: ctl.advice is not None and not ctl.busy, timeout=WAIT_MS)
        assert _cells(panel.totals, 0) == list(DEFAULT_RULES)
        heads = [panel.totals.horizontalHeaderItem(j).text() for j in range(panel.totals.columnCount())]
        assert heads[1] == "what would make it cache"  # beside the name, read first
        assert _cells(panel.totals, heads.index("hit ratio"))[0] == "0.0%"  # OpenAI's hit ratio
        assert "as of 2026-12-04" in panel.totals.item(0, 0).toolTip()
        html = panel.groups.toHtml()
        assert "11 of 12 requests diverge in message 0 (system) at characters 14-33" in html
        assert "2026-11-29T10:21:50Z" in html and HIGHLIGHT[1:] in html.lower()
        assert "move a timestamp or date" in panel.whatif_label.text()
        after = float(_cells(panel.whatif, 2)[0].rstrip("%"))
        assert after > 80  # OpenAI's hit ratio once the timestamp moves
        assert "chat.jsonl: 12 requests" in panel.trace_label.text()
    finally:
        ctl.close()


def test_try_the_example_explains_per_provider_what_would_make_it_cache(qtbot, real_model):
    """The tab opens with "Try the example" (the shipped trace, nothing to find first), and each
    provider's row says what would make it cache; Anthropic's names the breakpoint it needs."""
    panel = AdvisorPanel()
    qtbot.addWidget(panel)
    assert panel.example_button.isEnabled() and "try the example" in panel.trace_label.text().lower()
    ctl = AdvisorController(panel, lambda: "", lambda: real_model.tokenizer)
    try:
        panel.example_button.click()
        qtbot.waitUntil(lambda: ctl.advice is not None and not ctl.busy, timeout=WAIT_MS)
        label = panel.trace_label.text()
        assert "chat-timestamp.jsonl" in label and "20 requests" in label
        names = _cells(panel.totals, 0)
        assert names == list(DEFAULT_RULES)
        hints = {n: panel.hint(i) for i, n in enumerate(names)}
        assert all(hints.values()), hints
        anthropic = hints["anthropic"]
        assert "cache_control breakpoint at the end of the system prompt" in anthropic
        assert "move a timestamp" in anthropic  # the system prompt itself diverges: the fix first
        ratios = anthropic.split(": ")[-1].split(" cached")[0]  # "0% -> 92%"
        before, after = (int(x.rstrip("%")) for x in ratios.split(" -> "))
        assert before == 0 and after > 50
        assert "move a timestamp" in hints["openai"] and "saved" in hints["openai"]
    finally:
        ctl.close()


def test_the_proxys_traffic_is_advised_live(qtbot, real_model):
    server = start_server(scheduler_on(real_model, page_rows=16))
    panel = AdvisorPanel()
    qtbot.addWidget(panel)
    ctl = AdvisorController(panel, lambda: "", lambda: real_model.tokenizer)
    try:
        panel.upstream.setText(server.url + "/v1")
        panel.port.setValue(0)  # any free port
        panel.proxy_button.click()
        assert ctl.proxy is not None and "0 requests recorded" in panel.proxy_label.text()
        client = openai.OpenAI(base_url=ctl.proxy.url + "/v1", api_key="unused", max_retries=0)
        for _ in range(2):
            client.chat.completions.create(**ASK)
        qtbot.waitUntil(lambda: "2 requests recorded" in panel.proxy_label.text(), timeout=WAIT_MS)
        advised = "the proxy's traffic: 2 requests"
        qtbot.waitUntil(lambda: advised in panel.trace_label.text(), timeout=WAIT_MS)
        assert panel.totals.rowCount() == 6
        panel.proxy_button.click()
        assert ctl.proxy is None and panel.proxy_button.text() == "Start proxy"
        panel.upstream.setText("not a url")
        panel.proxy_button.click()
        assert "cannot start the proxy: --upstream must be an http:// or https:// URL" in panel.error.text()
        assert not panel.proxy_button.isChecked()
    finally:
        ctl.close()
        server.stop()


def test_the_window_has_an_advisor_tab(open_desktop):
    d = open_desktop()
    tabs = d.window.tabs
    assert "Advisor" in [tabs.tabText(i) for i in range(tabs.count())]
    d.advisor.load_trace("/nonexistent.jsonl")  # no model loaded yet: said, not raised
    assert "load a model first" in d.window.advisor.error.text()


def test_the_session_report_carries_the_advice(real_model, tmp_path, qtbot):
    from app.advise.advisor import Tokenizers, advise
    from app.advise.rules import resolve_rules
    from app.advise.traffic import read_traffic
    from app.report import load_report
    from app.report.render import export_report
    from engine.loop import EngineLoop
    from tests.test_report import SYSTEM, TITLE, build_report

    loop = EngineLoop(real_model)
    sch = loop.scheduler
    loop.submit_now(system=SYSTEM, user="Do you sell rakes?", max_new_tokens=2)
    loop.run_until_done()
    report = build_report(sch, real_model, SYSTEM, None, title=TITLE)
    path = timestamp_log(tmp_path)
    report.advice = advise(path, read_traffic(path), resolve_rules("openai"),
                           Tokenizers(real_model.tokenizer))
    html, js, pdf = (str(tmp_path / f"r.{ext}") for ext in ("html", "json", "pdf"))
    for out in (html, js, pdf):
        export_report(out, report)
    text = open(html, encoding="utf-8").read()
    assert "Prompt-caching advice" in text and "11 of 12 requests diverge in message 0 (system)" in text
    assert 'data-rules="openai"' in text and "What if you move a timestamp or date" in text
    assert load_report(js).advice["groups"][0]["kind"] == "timestamp"
    assert os.path.getsize(pdf) > 0


def test_the_apps_server_traffic_is_advised_live(open_desktop, qtbot, tiny_gguf_path):
    import httpx

    from app.bench.serve import free_port
    from tests.gui_helpers import LOAD_TIMEOUT_MS, SYSTEM, set_settings
    d = open_desktop(autoload=True, model_path=tiny_gguf_path)
    d.window.show()
    c, w = d.controller, d.window
    qtbot.waitUntil(lambda: c.model_info is not None, timeout=LOAD_TIMEOUT_MS)
    port = free_port()
    set_settings(d, server_port=port, max_new_tokens=4)
    w.act_server.trigger()
    assert d.advisor.following_server
    for q in ("Any paint?", "Any glue?"):
        body = {"model": "m", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200
    live = "the server's traffic: 2 requests"
    qtbot.waitUntil(lambda: live in w.advisor.trace_label.text(), timeout=WAIT_MS)
    rows = d.advisor.advice["rule_sets"][-1]["requests"]  # this engine's rules beside what it did
    qtbot.waitUntil(lambda: len(c.finished_records) == 2, timeout=WAIT_MS)
    assert [r["upstream_cached_tokens"] for r in rows] == [r.n_cached for r in c.finished_records]
    assert rows[1]["upstream_cached_tokens"] > 0
    w.act_server.trigger()  # off: no more observing
    assert not d.advisor.following_server


def test_served_requests_reach_the_advisor_as_their_chat_messages(tiny_model):
    """The app's own server traffic is advised per message, as a proxy's recording would be."""
    from app.desktop.advisor_controller import served_record
    from app.serve.server import Backend
    from engine.loop import EngineLoop, Job
    from engine.scheduler import FinishEvent

    loop = EngineLoop(tiny_model)
    backend = Backend(loop, model=lambda: tiny_model, stats=dict)
    seen: list = []
    backend.watchers.append(
        lambda job, ev: isinstance(ev, FinishEvent) and seen.append(served_record(job, ev)))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    done: list = []
    backend.submit(Job({"messages": messages, "max_new_tokens": 2}, client="http 127.0.0.1"), done.append)
    typed_job = Job({"user": "typed", "max_new_tokens": 2}, done.append)  # typed: not served
    loop.submit(typed_job)
    loop.run_until_done()
    finishes = [e for e in done if isinstance(e, FinishEvent)]
    assert len(finishes) == 2
    (line,) = seen  # only the served job reached the server's watchers
    typed = served_record(typed_job, next(f for f in finishes if f.request_id == typed_job.request_id))
    assert line["body"] == {"messages": messages} and typed is None
    assert line["usage"]["prompt_tokens"] > 0
