"""`prefixlab proxy` in front of a real `prefixlab serve` (and a hostile upstream), driven by the real
openai client: answers byte for byte as the upstream's, usage recorded, API keys never written."""

from __future__ import annotations

import json
import os
import re
import secrets

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from app.advise.advisor import Tokenizers, advise
from app.advise.rules import resolve_rules
from app.advise.traffic import read_traffic
from app.proxy.cli import Proxy
from app.serve.runner import HttpThread
from tests.serve_helpers import scheduler_on, start_server

KEY = "sk-proxytest-" + secrets.token_hex(12)
SYSTEM = "You are a friendly assistant for a small hardware store. Answer in one short sentence."
ASK = {"model": "anything", "temperature": 0, "max_tokens": 6,
       "messages": [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "What glue works on wood?"}]}


def _per_call(data: bytes) -> bytes:
    """The bytes without the values an upstream makes up per call: the id, the time, and the
    milliseconds it measured (llama.cpp's timings)."""
    return re.sub(rb'"(id|created|[a-z_]*(_ms|_per_second))": ?("[^"]*"|[-+.eE\d]+)', b'"\\1":_', data)


@pytest.fixture
def served(real_model, tmp_path):
    """A real `prefixlab serve` with an API key, and a recording proxy in front of it."""
    server = start_server(scheduler_on(real_model, page_rows=16), api_keys=[KEY])
    proxy = Proxy(server.url + "/v1", port=0, record=str(tmp_path / "trace.jsonl")).start()
    yield server, proxy, tmp_path / "trace.jsonl"
    proxy.stop()
    server.stop()


def test_answers_are_the_upstreams_byte_for_byte_and_usage_is_recorded(served, real_model, tmp_path):
    server, proxy, record = served
    direct = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    via = openai.OpenAI(base_url=proxy.url + "/v1", api_key=KEY, max_retries=0)
    direct.chat.completions.create(**ASK)  # the prompt is cached now: both calls below hit alike
    a = direct.chat.completions.with_raw_response.create(**ASK)
    b = via.chat.completions.with_raw_response.create(**ASK)
    assert _per_call(b.http_response.content) == _per_call(a.http_response.content)
    assert b.http_response.headers["content-type"] == a.http_response.headers["content-type"]
    cached = b.parse().usage.prompt_tokens_details.cached_tokens
    assert cached > 0

    streams = []
    for client in (direct, via):
        with client.chat.completions.with_streaming_response.create(
                **ASK, stream=True, stream_options={"include_usage": True}) as r:
            streams.append(b"".join(r.iter_bytes()))
    assert _per_call(streams[1]) == _per_call(streams[0])
    assert streams[1].rstrip().endswith(b"data: [DONE]")

    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [rec["endpoint"] for rec in lines] == ["/v1/chat/completions"] * 2
    assert lines[0]["body"] == json.loads(b.http_request.content)
    assert lines[0]["model"] == "anything"
    assert lines[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert lines[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # read from the stream
    assert lines[1]["timings"]["cache_n"] == lines[1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert lines[0]["key"] and KEY not in lines[0]["key"]

    # the recording is a trace the advisor reads, with the upstream's own numbers beside the rules'
    requests = read_traffic(str(record))
    advice = advise(str(record), requests, resolve_rules("prefixlab"), Tokenizers(real_model.tokenizer))
    rows = advice["rule_sets"][0]["requests"]
    assert [r["upstream_cached_tokens"] for r in rows] == [cached, lines[1]["timings"]["cache_n"]]
    assert rows[1]["common_prefix_tokens"] == rows[1]["prompt_tokens"]  # the same prompt twice

    for folder, _, files in os.walk(tmp_path):
        for name in files:
            with open(os.path.join(folder, name), "rb") as fh:
                assert KEY.encode() not in fh.read(), f"the API key was written to {name}"


def _hostile_upstream() -> HttpThread:
    """A real HTTP server that answers 500 with plain text, or cuts a stream after one event."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        if not body.get("stream"):
            return PlainTextResponse("boom: the model fell over", status_code=500)

        async def events():
            yield b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m",' \
                  b'"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}\n\n'
            raise RuntimeError("the upstream dies mid-answer")
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models():
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model", "created": 1,
                                                         "owned_by": "test"}]})
    return HttpThread(app, "127.0.0.1", 0).start()


def test_a_failing_upstream_gives_clear_errors_and_the_proxy_keeps_serving(tmp_path):
    upstream = _hostile_upstream()
    record = tmp_path / "trace.jsonl"
    proxy = Proxy(upstream.url, port=0, record=str(record)).start()
    try:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.InternalServerError, match="answered 500: boom: the model fell over"):
            client.chat.completions.create(**ASK)
        with pytest.raises(openai.APIError, match="closed the connection mid-answer"):
            for _ in client.chat.completions.create(**ASK, stream=True):
                pass
        assert [m.id for m in client.models.list()] == ["m"]  # still serving
        huge = {**ASK, "messages": [{"role": "user", "content": "x" * (17 << 20)}]}
        r = httpx.post(proxy.url + "/v1/chat/completions", json=huge, timeout=60)
        assert r.status_code == 500 and "boom" in r.json()["error"]["message"]  # forwarded all the same
        records = [json.loads(line) for line in record.read_text().splitlines()]
        assert "answered 500" in records[0]["error"] and "mid-answer" in records[1]["error"]
        assert "over what a trace line may hold" in records[2]["body_omitted"] and "body" not in records[2]
        skipped: list = []
        kept = read_traffic(str(record), skipped)  # refused and body-less records are not traffic
        assert [r.line for r in kept] == [2] and [k["line"] for k in skipped] == [1, 3]
        assert skipped[0]["why"] == "the upstream answered 500"
    finally:
        proxy.stop()
        upstream.stop()
    assert KEY not in record.read_text()


def test_an_unreachable_upstream_is_named(tmp_path):
    dead = HttpThread(FastAPI(), "127.0.0.1", 0)
    url = dead.url
    dead.sock.close()  # nothing listens there now
    proxy = Proxy(url, port=0).start()
    try:
        r = httpx.post(proxy.url + "/v1/chat/completions", json=ASK)
        assert r.status_code == 502
        assert "cannot be reached" in r.json()["error"]["message"] and url in r.json()["error"]["message"]
        assert httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}).status_code == 502
    finally:
        proxy.stop()


def test_proxy_options_are_checked(tmp_path, capsys):
    from app.cli import main
    with pytest.raises(SystemExit, match="--upstream must be an http:// or https:// URL"):
        main(["proxy", "--upstream", "ftp://example.com"])
    with pytest.raises(SystemExit, match="the folder .* does not exist"):
        main(["proxy", "--upstream", "http://127.0.0.1:9", "--record", str(tmp_path / "no" / "t.jsonl")])


def test_the_proxy_command_serves_until_sigterm(tmp_path):
    import signal
    import subprocess
    import sys
    record = tmp_path / "t.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "proxy", "--upstream", "http://127.0.0.1:9/v1",
                             "--port", "0", "--record", str(record)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        url = re.search(r"(http://127\.0\.0\.1:\d+)/v1 -> http://127\.0\.0\.1:9/v1", first).group(1)
        r = httpx.post(url + "/v1/chat/completions", json=ASK, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 502 and "cannot be reached" in r.json()["error"]["message"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    assert "stopping" in proc.stderr.read()
    assert json.loads(record.read_text())["status"] == 502 and KEY not in record.read_text()


@pytest.mark.skipif(__import__("shutil").which("llama-server") is None,
                    reason="no llama-server binary on PATH (llama.cpp's server)")
def test_the_proxy_records_llama_servers_cache_n(real_model, tmp_path):
    import subprocess
    import time
    port = 18000 + os.getpid() % 1000 + 7
    proc = subprocess.Popen(["llama-server", "-m", real_model.path, "--port", str(port), "-c", "2048"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    upstream = f"http://127.0.0.1:{port}"
    proxy = None
    try:
        end = time.monotonic() + 60
        while time.monotonic() < end:
            try:
                if httpx.get(upstream + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        proxy = Proxy(upstream + "/v1", port=0, record=str(tmp_path / "t.jsonl")).start()
        direct = openai.OpenAI(base_url=upstream + "/v1", api_key=KEY, max_retries=0)
        via = openai.OpenAI(base_url=proxy.url + "/v1", api_key=KEY, max_retries=0)
        direct.chat.completions.create(**ASK)
        a = direct.chat.completions.with_raw_response.create(**ASK)
        b = via.chat.completions.with_raw_response.create(**ASK)
        assert _per_call(b.http_response.content) == _per_call(a.http_response.content)
        rec = json.loads((tmp_path / "t.jsonl").read_text().splitlines()[0])
        assert rec["timings"]["cache_n"] == b.parse().model_extra["timings"]["cache_n"] > 0
    finally:
        if proxy is not None:
            proxy.stop()
        proc.terminate()
        proc.wait(10)


def test_a_compressed_answer_passes_as_it_is_and_its_usage_is_read(tmp_path):
    from fastapi.middleware.gzip import GZipMiddleware
    app = FastAPI()
    app.add_middleware(GZipMiddleware, minimum_size=0)
    answer = {"id": "c", "object": "chat.completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "Wood glue."},
                           "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 2048, "completion_tokens": 3, "total_tokens": 2051,
                        "prompt_tokens_details": {"cached_tokens": 1920}}}

    @app.post("/v1/chat/completions")
    async def chat():
        return JSONResponse(answer)
    upstream = HttpThread(app, "127.0.0.1", 0).start()
    proxy = Proxy(upstream.url + "/v1", port=0, record=str(tmp_path / "t.jsonl")).start()
    try:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=KEY, max_retries=0)
        r = client.chat.completions.with_raw_response.create(**ASK)
        assert r.http_response.headers["content-encoding"] == "gzip"
        assert r.parse().choices[0].message.content == "Wood glue."
        rec = json.loads((tmp_path / "t.jsonl").read_text())
        assert rec["usage"]["prompt_tokens_details"]["cached_tokens"] == 1920
    finally:
        proxy.stop()
        upstream.stop()


def _messages_upstream(seen: list) -> HttpThread:
    """A real HTTP server speaking Anthropic's Messages API: the usage split into cache reads,
    cache writes and plain input, streamed in message_start / message_delta events when asked."""
    app = FastAPI()
    usage = {"input_tokens": 12, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 2000,
             "output_tokens": 1}

    @app.post("/v1/messages")
    async def messages(request: Request):
        body = await request.json()
        seen.append(request.headers.get("x-api-key"))
        message = {"id": "msg_1", "type": "message", "role": "assistant", "model": body["model"],
                   "content": [{"type": "text", "text": "PVA glue."}], "stop_reason": "end_turn",
                   "usage": usage}
        if not body.get("stream"):
            return JSONResponse(message)

        def event(kind: str, data: dict) -> bytes:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()

        async def events():
            yield event("message_start", {"message": {**message, "content": [],
                                                      "usage": {**usage, "output_tokens": 1}}})
            yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
            yield event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "PVA"}})
            yield event("content_block_stop", {"index": 0})
            yield event("message_delta", {"delta": {"stop_reason": "end_turn"},
                                          "usage": {"output_tokens": 7}})
            yield event("message_stop", {})
        return StreamingResponse(events(), media_type="text/event-stream")
    return HttpThread(app, "127.0.0.1", 0).start()


def test_the_proxy_records_anthropics_messages_api(real_model, tmp_path):
    seen: list = []
    upstream = _messages_upstream(seen)
    proxy = Proxy(upstream.url, port=0, record=str(tmp_path / "t.jsonl")).start()
    body = {"model": "claude-sonnet-4-5", "max_tokens": 20,
            "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What glue works on wood?"}]}]}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    try:
        with httpx.Client(base_url=proxy.url, headers=headers, timeout=30) as client:
            plain = client.post("/v1/messages", json=body)
            assert plain.json()["content"][0]["text"] == "PVA glue."
            with client.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
                streamed = b"".join(r.iter_bytes())
        assert b"event: message_stop" in streamed
    finally:
        proxy.stop()
        upstream.stop()
    assert seen == [KEY, KEY]  # the key went upstream
    raw = (tmp_path / "t.jsonl").read_text()
    assert KEY not in raw  # and was never written
    lines = [json.loads(line) for line in raw.splitlines()]
    assert [rec["endpoint"] for rec in lines] == ["/v1/messages"] * 2
    for rec in lines:
        assert rec["usage"]["cache_read_input_tokens"] == 2000
        assert rec["usage"]["cache_creation_input_tokens"] == 0 and rec["usage"]["input_tokens"] == 12
    assert lines[1]["usage"]["output_tokens"] == 7  # message_delta's count added to message_start's
    assert all(0 <= rec["first_byte_ms"] < 30_000 for rec in lines)  # when each answer began
    assert lines[0]["key"] and lines[0]["body"]["system"][0]["cache_control"]["ttl"] == "1h"

    requests = read_traffic(str(tmp_path / "t.jsonl"))
    assert [(r.upstream_prompt_tokens, r.upstream_cached_tokens, r.upstream_cache_write_tokens)
            for r in requests] == [(2012, 2000, 0)] * 2
    assert requests[0].messages[0].long == [True]  # the 1-hour mark is read
    advice = advise(str(tmp_path / "t.jsonl"), requests, resolve_rules("anthropic"),
                    Tokenizers(real_model.tokenizer))
    rs = advice["rule_sets"][0]
    assert [r["upstream_cached_tokens"] for r in rs["requests"]] == [2000, 2000]
    assert rs["error"]["requests"] == 2 and "mean_abs_error_tokens" in rs["error"]


def test_the_prediction_under_this_engines_rules_equals_what_serve_reported(served, real_model):
    """Every request through the proxy, none around it: the advice's prediction under the
    `prefixlab` rules is exactly the upstream's cached_tokens, request by request."""
    server, proxy, record = served
    via = openai.OpenAI(base_url=proxy.url + "/v1", api_key=KEY, max_retries=0)
    asks = ["What glue works on wood?", "What glue works on wood?", "Which paint for a fence?",
            "Do you sell lumber?", "Which paint for a fence?"]
    for k, q in enumerate(asks):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        if k == 3:  # a longer conversation: an earlier turn kept, a new one added
            messages += [{"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Pine?"}]
        via.chat.completions.create(**{**ASK, "messages": messages})
    advice = advise(str(record), read_traffic(str(record)), resolve_rules("prefixlab"),
                    Tokenizers(real_model.tokenizer))
    rs = advice["rule_sets"][0]
    rows = rs["requests"]
    assert [r["cached_tokens"] for r in rows] == [r["upstream_cached_tokens"] for r in rows]
    assert sum(r["cached_tokens"] for r in rows) > 0
    assert rs["error"] == {"requests": 5, "exact": 5, "mean_abs_error_tokens": 0.0}
    from app.advise.cli import summary
    from app.advise.html import render_html, view_data
    assert "prefixlab: against the upstream: 5 of 5 requests exact, mean error 0.0 tokens" in summary(advice)
    page = render_html(advice)
    assert "Prediction against the upstream" in page and "5 of 5 requests exact" in page
    data = view_data(advice)  # the Advisor tab's and the session report's rows
    assert data["totals_head"][-1] == "against the upstream"
    assert data["totals_rows"][0][-1].startswith("5 of 5")


def test_an_answer_whose_usage_goes_unread_says_why_in_the_recording_and_the_advice(real_model, tmp_path):
    from fastapi.middleware.gzip import GZipMiddleware

    from app.advise.html import error_text
    from app.proxy.limits import Limits
    app = FastAPI()
    app.add_middleware(GZipMiddleware, minimum_size=0)
    answer = {"id": "c", "object": "chat.completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * 4096},
                           "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 30, "completion_tokens": 3, "total_tokens": 33,
                        "prompt_tokens_details": {"cached_tokens": 0}}}

    @app.post("/v1/chat/completions")
    async def chat():
        return JSONResponse(answer)
    upstream = HttpThread(app, "127.0.0.1", 0).start()
    record = tmp_path / "t.jsonl"
    proxy = Proxy(upstream.url + "/v1", port=0, record=str(record),
                  limits=Limits(max_decoded_bytes=1024)).start()
    try:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=KEY, max_retries=0)
        assert client.chat.completions.create(**ASK).choices[0].message.content == "x" * 4096
    finally:
        proxy.stop()
        upstream.stop()
    rec = json.loads(record.read_text())
    assert "usage" not in rec and "1,024 bytes" in rec["usage_unread"]
    requests = read_traffic(str(record))
    advice = advise(str(record), requests, resolve_rules("openai"), Tokenizers(real_model.tokenizer))
    rs = advice["rule_sets"][0]
    assert rs["requests"][0]["upstream_usage_unread"] == rec["usage_unread"]
    assert rs["error"]["unread"] == {"requests": 1, "why": rec["usage_unread"]}
    assert "1 answers' usage unread" in error_text(rs)
