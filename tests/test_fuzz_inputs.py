"""Fuzz targets for every input surface: HTTP bodies, trace lines, report files, KV-event frames.

Each property: whatever arrives, the reader answers with its own clear error (ApiError, an
OpenAI error object, TraceError, ValueError, a counted bad frame) and never anything else.
Budgets are small (CI stays fast); raise max_examples locally to search longer.
"""

# ruff: noqa: E402  (Qt must see QT_QPA_PLATFORM before anything imports it)
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.advise.traffic import read_traffic
from app.kv_wire import BadFrame, decode_batch
from app.replay.trace import TraceError, open_trace
from app.report import load_report, report_to_dict, snapshot_from_report
from app.serve.protocol import ApiError
from app.serve.runner import Server
from app.serve.server import _parse
from tests.test_report_hardening import small_report

FAST = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
LIVE = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))

# JSON values, with the awkward ones: lone surrogates, huge and non-finite numbers, nesting
_text = st.text(alphabet=st.characters(blacklist_categories=()), max_size=12) | st.sampled_from(
    ["\ud800", "x\udfffy", "", "user", "assistant", "system", "tool", "text", "image_url"])
_leaf = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | _text)
json_values = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(_text | st.sampled_from(
                               ["role", "content", "messages", "prompt", "max_tokens", "stop", "type"]),
                               inner, max_size=4), max_leaves=20)
FIELDS = ["messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "repeat_penalty", "seed", "stop", "stream", "stream_options", "user", "cache_salt", "n",
          "tools", "response_format", "logprobs", "ignore_eos", "model", "echo", "suffix"]
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6)
chat_messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer"]) | _text,
     "content": json_values}), min_size=1, max_size=3)


def encoded(value) -> bytes:
    return json.dumps(value, ensure_ascii=True, allow_nan=True).encode()


# --- HTTP bodies ----------------------------------------------------------------------------------

@FAST
@given(body=bodies, messages=chat_messages, chat=st.booleans())
def test_fuzz_request_bodies_parse_or_are_a_400(body, messages, chat):
    if chat and "messages" not in body:
        body = {**body, "messages": messages}
    try:
        _parse(encoded(body), chat)
    except ApiError as e:
        assert e.status == 400 and e.message


@FAST
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_fuzz_raw_bytes_are_a_400(raw):
    with pytest.raises(ApiError) as e:
        _parse(raw, True)
    assert e.value.status == 400


@pytest.fixture(scope="module")
def loading_server():
    """A real server whose model is still 'loading': every checked request reaches the 503."""
    gate = threading.Event()

    def never_loads():
        gate.wait(3600)
        raise RuntimeError("the test ended before the model loaded")
    srv = Server(never_loads, port=0).start()
    yield srv
    gate.set()
    srv.stop()


@LIVE
@given(body=bodies | json_values, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       kind=st.sampled_from(["application/json", "text/plain", "", "application/json; charset=utf-8"]))
def test_fuzz_http_bodies_get_error_objects(loading_server, body, path, kind):
    r = httpx.post(loading_server.url + path, content=encoded(body), headers={"content-type": kind},
                   timeout=30)
    assert r.status_code in (400, 415, 503), r.text
    error = r.json()["error"]
    assert error["message"] and "Traceback" not in r.text


# --- trace lines ----------------------------------------------------------------------------------

trace_rows = st.dictionaries(st.sampled_from(["timestamp", "input_length", "output_length", "hash_ids",
                                              "arrival_s", "prompt", "messages", "max_tokens", "namespace"]),
                             json_values, max_size=5)


@FAST
@given(rows=st.lists(trace_rows | json_values, min_size=1, max_size=4),
       fmt=st.sampled_from(["mooncake", "prefixlab", None]))
def test_fuzz_trace_lines_read_or_name_the_line(tmp_path_factory, rows, fmt):
    path = tmp_path_factory.mktemp("trace") / "t.jsonl"
    head = [{"format": "prefixlab.trace/1", "page_rows": 4}] if fmt == "prefixlab" else []
    path.write_bytes(b"".join(encoded(r) + b"\n" for r in head + rows))
    try:
        for request in open_trace(str(path), fmt):
            assert request.input_length >= 0 and request.arrival_s == request.arrival_s
    except TraceError as e:
        assert str(path) in str(e)


# --- advise lines ---------------------------------------------------------------------------------

ADVISE_FIELDS = ["messages", "prompt", "timestamp", "body", "endpoint", "status", "usage", "key", "tools",
                 "system", "hash_ids", "format"]
advise_rows = st.dictionaries(st.sampled_from(ADVISE_FIELDS), json_values | chat_messages, max_size=5)
nested = st.integers(1, 3000).map(lambda depth: b'{"messages": ' + b"[" * depth + b"]" * depth + b"}")
advise_lines = (advise_rows.map(encoded) | json_values.map(encoded) | st.binary(max_size=80) | nested
                | st.just(b'{"messages": [{"role": "user", "content": "hi"}], "timestamp": Infinity}'))


@FAST
@given(lines=st.lists(advise_lines, min_size=1, max_size=5), strict=st.booleans())
def test_fuzz_advise_lines_parse_or_are_skipped_and_counted(tmp_path_factory, lines, strict):
    """Any line of a recording is a request or one counted skip; never a traceback."""
    path = tmp_path_factory.mktemp("advise") / "rec.jsonl"
    data = b"\n".join(lines) + b"\n"
    path.write_bytes(data)
    skipped: list = []
    try:
        requests = read_traffic(str(path), skipped, strict=strict)
    except TraceError as e:
        assert str(path) in str(e)
        return
    if not strict and not data.startswith(b'{"format": "prefixlab.trace/1"'):
        assert len(requests) + len(skipped) == sum(1 for line in data.split(b"\n") if line.strip())
    assert all(r.arrival_s == r.arrival_s and r.arrival_s != float("inf") for r in requests)


# --- report files ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def report_dict(tiny_model):
    return report_to_dict(small_report(tiny_model))


def _leaves(value, path=()):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(value, list) and value:
        for i, v in enumerate(value):
            yield from _leaves(v, (*path, i))
    else:
        yield path


@FAST
@given(data=st.data())
def test_fuzz_report_files_load_or_say_what_is_wrong(report_dict, tmp_path_factory, data):
    doc = json.loads(json.dumps(report_dict))
    leaves = list(_leaves(doc))
    for _ in range(data.draw(st.integers(1, 3))):
        *parents, last = data.draw(st.sampled_from(leaves))
        target = doc
        for key in parents:
            target = target[key]
        target[last] = data.draw(json_values)
    path = tmp_path_factory.mktemp("report") / "r.json"
    path.write_bytes(encoded(doc))
    try:
        report = load_report(path)
    except ValueError as e:
        assert str(path) in str(e)
    else:
        snapshot_from_report(report)  # what the window shows: must not raise on a report that loaded


# --- KV-event frames ------------------------------------------------------------------------------

@FAST
@given(depth=st.integers(1, 5000), wrap=st.sampled_from([b"\x91", b"\x81\xa1k"]))
def test_fuzz_deeply_nested_kv_event_payloads_are_bad_frames(depth, wrap):
    payload = wrap * depth + b"\xc0"  # arrays (or maps) inside each other, then nil
    try:
        batch, bad = decode_batch(payload)
    except BadFrame:
        return
    assert bad >= 0 and isinstance(batch.events, list)
