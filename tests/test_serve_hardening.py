"""`prefixlab serve` against hostile input: one bad request is refused alone, the server stays up.

Surrogates, NaN-making penalties, deep JSON, huge bodies, non-JSON posts and foreign Host
headers each get a clean OpenAI error object; requests running beside them finish.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest

from app.serve.guard import DEFAULT_MAX_BODY_BYTES
from tests.serve_helpers import pages_held_by_sessions, scheduler_on, start_server, wait_idle

pytestmark = pytest.mark.model
HEALTH_GENEROUS_S = 5.0  # only "not stalled for the whole upload"; speed is the bench's job


@pytest.fixture(scope="module")
def server(real_model):
    srv = start_server(scheduler_on(real_model, max_streams=4), allowed_hosts=["prefixlab.test"])
    yield srv
    srv.stop()


def post(server, path: str, raw: bytes, **headers) -> httpx.Response:
    headers = {"content-type": "application/json", **headers}
    return httpx.post(server.url + path, content=raw, headers=headers, timeout=120)


def still_serves(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
    r = client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert r.usage.completion_tokens == 2


CHAT, HI = "/v1/chat/completions", '"messages": [{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize("path, body, param", [
    (CHAT, '{"messages": [{"role": "user", "content": "x\\ud800y"}]}', "messages[0].content"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages[0].content[0].text"),
    (CHAT, '{' + HI + ', "stop": ["\\ud800"]}', "stop[0]"),
    (CHAT, '{' + HI + ', "user": "a\\ud800"}', "user"),
    ("/v1/completions", '{"prompt": "x\\ud800y", "max_tokens": 2}', "prompt"),
])
def test_an_unpaired_surrogate_is_a_400_naming_the_field(server, path, body, param):
    r = post(server, path, body.encode())
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "surrogate" in error["message"]
    still_serves(server)


def test_a_nan_making_penalty_is_refused_while_a_running_request_finishes(server):
    body = {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
            "max_tokens": 40, "temperature": 1.0, "seed": 1, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as running:
        lines = running.iter_lines()
        next(line for line in lines if '"content": "' in line and '"content": ""' not in line)
        bad = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "again and again and again"}], "max_tokens": 20,
            "temperature": 1.0, "repeat_penalty": 1e-40})
        rest = list(lines)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "repeat_penalty"
    chunks = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
    assert not any("error" in c for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 40
    assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"


def test_json_nested_a_thousand_deep_is_a_400(server):
    deep = b'{"messages": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    r = post(server, "/v1/chat/completions", deep)
    assert r.status_code == 400 and "Traceback" not in r.text
    assert "nested too deeply" in r.json()["error"]["message"]
    still_serves(server)


def test_a_20_mb_body_is_413_while_health_answers(server):
    prompt = "word " * (4 * 1024 * 1024)
    raw = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    assert len(raw) > 20_000_000
    result, health_s = {}, []
    upload = threading.Thread(target=lambda: result.setdefault("r", post(server, "/v1/completions", raw)))
    upload.start()
    while upload.is_alive():
        t0 = time.perf_counter()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        health_s.append(time.perf_counter() - t0)
    upload.join()
    r = result["r"]
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert max(health_s) < HEALTH_GENEROUS_S, health_s
    still_serves(server)


def test_a_large_prompt_under_the_limit_is_tokenized_while_health_answers(server, real_model, monkeypatch):
    """A 6.5 MB prompt (under the 8 MiB body limit) keeps the tokenizer busy for seconds; /health
    requests sent meanwhile are answered meanwhile (no time threshold: their order against the
    tokenizer's start and end), and the prompt itself ends as a clean error object."""
    tok, spans = real_model.tokenizer, []
    encode_prompt = tok.encode_prompt

    def timed(text: str) -> list[int]:
        t0 = time.perf_counter()
        try:
            return encode_prompt(text)
        finally:
            spans.append((t0, time.perf_counter(), len(text)))

    monkeypatch.setattr(tok, "encode_prompt", timed)
    prompt = "".join(f"item{i % 5000} costs {i % 97} " for i in range(400_000))
    raw = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    assert 6_000_000 < len(raw) < DEFAULT_MAX_BODY_BYTES
    result, health = {}, []  # health: (sent, answered)

    def send() -> None:
        result["r"] = post(server, "/v1/completions", raw)
        result["done"] = time.perf_counter()

    big = threading.Thread(target=send)
    big.start()
    # A new connection per /health, as httpx.get makes, but one client: httpx.get builds an SSL
    # context each call (~80 ms of this process's CPU), which slowed the tokenizing 2.5x.
    with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=120) as client:
        while big.is_alive():
            sent = time.perf_counter()
            assert client.get(server.url + "/health").status_code == 200
            health.append((sent, time.perf_counter()))
    big.join()
    [(start, end)] = [(t0, t1) for t0, t1, n in spans if n == len(prompt)]
    during = [h for h in health if start < h[0] and h[1] < end]  # sent and answered while tokenizing
    assert len(during) >= 3, (start, end, health)
    assert max(answered for _, answered in during) < end < result["done"]
    r = result["r"]
    assert r.status_code == 400 and "Traceback" not in r.text, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "context" in error["message"], error
    still_serves(server)


def test_only_json_bodies_are_accepted(server):
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    for kind in ("text/plain", "application/x-www-form-urlencoded", ""):
        r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"content-type": kind})
        assert r.status_code == 415, kind
        assert r.json()["error"]["code"] == "unsupported_media_type"
    assert post(server, "/v1/chat/completions", body, **{"content-type": "application/json; charset=utf-8"}
                ).status_code == 200


def test_a_foreign_host_is_refused_and_allowed_hosts_widen_the_list(server):
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    evil = post(server, "/v1/chat/completions", body, host="evil.example:8000")
    assert evil.status_code == 400 and evil.json()["error"]["code"] == "invalid_host"
    assert httpx.get(server.url + "/health", headers={"host": "rebound.example"}).status_code == 400
    for host in (f"localhost:{server.http.port}", f"127.0.0.1:{server.http.port}", "prefixlab.test"):
        assert httpx.get(server.url + "/health", headers={"host": host}).status_code == 200, host


def test_no_cors_unless_asked(server):
    preflight = httpx.options(server.url + "/v1/chat/completions", headers={
        "origin": "https://evil.example", "access-control-request-method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers


def test_a_malformed_http_request_gets_an_error_object(server):
    with socket.create_connection(("127.0.0.1", server.http.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nBad Header Line\r\n\r\n")
        raw = b""
        while chunk := s.recv(4096):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert json.loads(body)["error"]["code"] == "bad_http_request"


def test_client_labels_are_bounded(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "user": "u" * 200_000})
    assert r.status_code == 200
    wait_idle(server)
    labels = [c["client"] for c in server.backend.friendliness.to_dict()["clients"]]
    assert labels and max(len(label) for label in labels) < 200


def test_a_client_that_hangs_up_is_one_log_line(server, caplog):
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 200,
            "stream": True}
    with caplog.at_level("WARNING", logger="prefixlab.serve"):
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            next(line for line in r.iter_lines() if '"content": "' in line and '"content": ""' not in line)
        wait_idle(server)
        deadline = time.monotonic() + 30
        while not any("disconnected" in m for m in caplog.messages) and time.monotonic() < deadline:
            time.sleep(0.05)
    lines = [m for m in caplog.messages if "disconnected" in m]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert pages_held_by_sessions(server) == 0


# --- round 3: parameters named, connections bounded -------------------------------------------------

def chat(server, **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 3, **fields}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def test_an_empty_stop_list_is_no_stop(server):
    r = chat(server, stop=[], temperature=0)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def test_a_negative_seed_is_a_400_naming_seed(server):
    r = chat(server, seed=-1)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "seed" and "'seed'" in error["message"] and "-1" in error["message"]


def test_logit_bias_names_a_token_the_model_does_not_have_and_applies_the_others(server, real_model):
    vocab = real_model.config.vocab_size
    r = chat(server, logit_bias={"5": 1, str(vocab + 7): -100})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "logit_bias"
    assert str(vocab + 7) in error["message"] and str(vocab) in error["message"], error
    forced = real_model.tokenizer.encode(" banana")[0]
    r = chat(server, temperature=0, max_tokens=2, logit_bias={str(forced): 100})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == real_model.tokenizer.decode([forced]) * 2


@pytest.fixture
def limited_server(real_model):
    srv = start_server(scheduler_on(real_model, max_streams=2), max_connections=50, idle_timeout_s=30)
    yield srv
    srv.stop()


def _closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(0)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_idle_connections_over_the_limit_leave_health_answering_and_log_one_line(limited_server, caplog):
    """200 sockets that never send a request against a limit of 50 (the mechanism behind 20,000
    exhausting the descriptors): the oldest idle ones make room, /health answers at once, and
    the burst is one log line, not one per connection."""
    with caplog.at_level("WARNING", logger="prefixlab.serve"):
        socks = [socket.create_connection(("127.0.0.1", limited_server.http.port), timeout=10)
                 for _ in range(200)]
        try:
            t0 = time.perf_counter()
            assert httpx.get(limited_server.url + "/health", timeout=10).status_code == 200
            assert time.perf_counter() - t0 < 1.0
            still_serves(limited_server)
            deadline = time.monotonic() + 10
            while not any("connection limit" in m for m in caplog.messages) and time.monotonic() < deadline:
                time.sleep(0.05)
            open_ = [s for s in socks if not _closed_by_server(s)]
        finally:
            for s in socks:
                s.close()
    lines = [m for m in caplog.messages if "connection limit" in m]
    assert len(lines) == 1, lines
    assert "--max-connections" in lines[0] and "50" in lines[0]
    assert len(open_) <= 50  # the newest held on; the rest were closed to stay under the limit


def test_a_connection_that_sends_nothing_is_closed_after_the_idle_timeout(real_model):
    srv = start_server(scheduler_on(real_model, max_streams=1), idle_timeout_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", srv.http.port), timeout=10) as idle:
            idle.settimeout(5)
            t0 = time.perf_counter()
            assert idle.recv(1) == b""  # the server closed it
            assert 0.4 < time.perf_counter() - t0 < 3.0
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    finally:
        srv.stop()


def test_serve_refuses_connection_options_out_of_range(capsys):
    from app.cli import main
    from app.serve.guard import descriptor_limit
    with pytest.raises(SystemExit, match=r"--max-connections must be from 1 to \d+"):
        main(["serve", "--port", "0", "--max-connections", str(descriptor_limit() * 2)])
    with pytest.raises(SystemExit, match=r"--max-connections must be from 1 to \d+ .*got 0"):
        main(["serve", "--port", "0", "--max-connections", "0"])
    with pytest.raises(SystemExit, match=r"--idle-timeout must be in \(0, 3600\]"):
        main(["serve", "--port", "0", "--idle-timeout", "0"])
