"""`prefixlab serve` with the real openai client: streaming, sharing, multi-turn, bad input, disconnects."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from app.cli import main
from app.scenario import SCENARIO_DIR, load_scenario
from tests.serve_helpers import pages_held_by_sessions, scheduler_on, start_server, wait_idle

pytestmark = pytest.mark.model
PAGE_ROWS = 16
MAX_TOKENS = 6
W8 = load_scenario(os.path.join(SCENARIO_DIR, "w8.json"))


@pytest.fixture(scope="module")
def server(real_model):
    srv = start_server(scheduler_on(real_model, max_streams=8, page_rows=PAGE_ROWS))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def stream_one(client, messages, **kw) -> tuple[str, object, str]:
    """Text, usage and finish reason of one streamed chat answer."""
    stream = client.chat.completions.create(model="gpt-4o-mini", messages=messages, stream=True,
                                            stream_options={"include_usage": True}, temperature=0, **kw)
    text, usage, finish = [], None, None
    for ch in stream:
        if ch.choices:
            text.append(ch.choices[0].delta.content or "")
            finish = ch.choices[0].finish_reason or finish
        else:
            usage = ch.usage
    return "".join(text), usage, finish


def run_texts(tmp_path, scenario: str, max_new: int) -> list[str]:
    """The answers `prefixlab run --scenario ... --json` gives (greedy), in prompt order."""
    out = tmp_path / "run.json"
    assert main(["run", "--scenario", scenario, "--max-new", str(max_new), "--max-streams", "8",
                 "--page-rows", str(PAGE_ROWS), "--temp", "0", "--quiet", "--json", str(out)]) == 0
    requests = sorted(json.loads(out.read_text())["requests"], key=lambda r: r["id"])
    return [r["text"] for r in requests]


def test_eight_concurrent_streams_share_the_system_prompt(server, client, tmp_path):
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda q: stream_one(client, chat(W8.system, q), max_tokens=MAX_TOKENS),
                                W8.prompts))
    assert all(finish == "length" for _, _, finish in results)
    cached = [usage.prompt_tokens_details.cached_tokens for _, usage, _ in results]
    assert sum(c > 0 for c in cached) >= 6, cached
    assert all(c % PAGE_ROWS == 0 for c in cached), cached
    assert all(usage.completion_tokens == MAX_TOKENS for _, usage, _ in results)
    assert [t for t, _, _ in results] == run_texts(tmp_path, W8.path, MAX_TOKENS)
    wait_idle(server)
    assert pages_held_by_sessions(server) == 0
    assert server.engine.loop.chat.kept() == 0  # served chats leave no conversation behind


def test_whole_conversation_resent_each_turn_hits_the_last_answer(client):
    messages = chat("You are a friendly travel guide. Answer in one sentence.", "Name a city in Italy.")
    usages = []
    for follow_up in ["Name one sight there.", "What should I eat there?", None]:
        r = client.chat.completions.create(model="any-name", messages=messages, max_tokens=8, temperature=0)
        usages.append(r.usage)
        if follow_up is None:
            break
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": follow_up}]
    turn2, turn3 = usages[1], usages[2]
    # Turn 2's prompt and answer (and the template's closing tokens) were donated: turn 3
    # attaches every full page of them.
    covered = (turn2.prompt_tokens + turn2.completion_tokens) // PAGE_ROWS * PAGE_ROWS
    assert turn3.prompt_tokens_details.cached_tokens >= covered > turn2.prompt_tokens


def test_answer_names_the_loaded_model_and_reports_timings(server, client):
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "model": "gpt-4o", "messages": chat(W8.system, "Hello"), "max_tokens": 3, "temperature": 0})
    body = r.json()
    assert r.status_code == 200 and body["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    t, u = body["timings"], body["usage"]
    assert t["cache_n"] == u["prompt_tokens_details"]["cached_tokens"] > 0
    assert t["prompt_n"] == u["prompt_tokens"] - t["cache_n"]
    assert t["predicted_n"] == u["completion_tokens"] == 3
    assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]


def test_completions_endpoint_streams_and_answers_whole(client):
    prompt = "The three primary colours are"
    whole = client.completions.create(model="x", prompt=prompt, max_tokens=5, temperature=0)
    pieces = [c.choices[0].text for c in client.completions.create(model="x", prompt=prompt, max_tokens=5,
                                                                    temperature=0, stream=True)
              if c.choices]
    assert whole.choices[0].text == "".join(pieces) != ""
    assert whole.usage.completion_tokens == 5 and whole.choices[0].finish_reason == "length"


def test_stop_string_cuts_the_answer_and_never_leaks_while_streaming(server, client):
    messages = chat("You are terse.", "What is the capital of France?")
    full = client.chat.completions.create(model="x", messages=messages, max_tokens=10, temperature=0)
    text = full.choices[0].message.content
    assert "Paris" in text, text
    stop = " Paris" if " Paris" in text else "Paris"
    wait_idle(server)
    stops_before = finished_count(server, "stop")
    cut = client.chat.completions.create(model="x", messages=messages, max_tokens=10, temperature=0,
                                         stop=[stop])
    streamed, _, finish = stream_one(client, messages, max_tokens=10, stop=stop)
    assert cut.choices[0].message.content == streamed == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == finish == "stop"
    # the engine's records (the report, /metrics, the Served view) say "stop" too, not "cancelled"
    wait_idle(server)
    last_two = sorted(server.engine.scheduler.records(), key=lambda rec: rec.id)[-2:]
    assert [r.finish_reason for r in last_two] == ["stop", "stop"]
    assert finished_count(server, "stop") == stops_before + 2


def finished_count(server, reason: str) -> int:
    """Served requests /metrics counts as finished with `reason`."""
    found = re.search(rf'requests_finished_total{{finish_reason="{reason}"}} (\d+)',
                      httpx.get(server.url + "/metrics").text)
    return int(found.group(1)) if found else 0


BAD = [
    ("not JSON", b"{bad json", 400),
    ("a JSON list", b"[1, 2]", 400),
    ("messages missing", {"model": "x"}, 400),
    ("messages of the wrong type", {"messages": "hi"}, 400),
    ("an unknown role", {"messages": [{"role": "robot", "content": "hi"}]}, 400),
    ("temperature a string", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400),
    ("max_tokens 0", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400),
    ("max_tokens negative", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, 400),
    ("max_completion_tokens a float", {"messages": [{"role": "user", "content": "hi"}],
                                       "max_completion_tokens": 2.5}, 400),
    ("n 2", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400),
    ("tools", {"messages": [{"role": "user", "content": "hi"}],
               "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    ("response_format json", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_object"}}, 400),
    ("stream not a boolean", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400),
    ("a prompt past the context", {"messages": [{"role": "user", "content": "seven " * 8300}]}, 400),
]


@pytest.mark.parametrize("what,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error_and_the_next_request_is_served(server, client, what, body, status):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + "/v1/chat/completions", headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status, (what, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in r.text
    ok = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert ok.choices[0].finish_reason == "length"


def test_unknown_path_is_404_and_the_openai_client_raises_its_errors(server, client):
    r = httpx.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=0)


def test_client_disconnect_mid_stream_cancels_and_frees_its_pages(server):
    body = {"messages": chat(W8.system, "Tell me a very long story about tents."), "max_tokens": 400,
            "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        got = []
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                got.append(line)
            if len(got) == 3:
                break
    # The response is closed: the server cancels the request and its session's pages go back.
    wait_idle(server)
    assert pages_held_by_sessions(server) == 0
    last = max(server.engine.scheduler.records(), key=lambda rec: rec.id)
    assert last.finish_reason == "cancelled" and last.n_gen < 400


def test_metrics_and_friendliness_describe_the_served_traffic(server, client):
    for minute in ("41", "42"):
        client.chat.completions.create(model="x", user="bob", max_tokens=1, messages=chat(
            f"Now: 2026-11-30T22:{minute}. " + W8.system, "Hi"))
    text = httpx.get(server.url + "/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["prefixlab_prefix_cache_hits_total"] > 0
    assert values["prefixlab_prefill_tokens_saved_total"] > 0
    assert values['prefixlab_time_to_first_token_seconds_bucket{le="+Inf"}'] == \
        values["prefixlab_time_to_first_token_seconds_count"] > 0
    assert 'prefixlab_pool_pages{state="cached"}' in values
    report = httpx.get(server.url + "/v1/prefixlab/friendliness").json()
    bob = next(c for c in report["clients"] if "user=bob" in c["client"])
    assert bob["requests"] == 2 and bob["prefill_tokens_saved"] > 0
    # The second prompt leaves the first one's pages at the minute's last digit.
    miss = next(m for m in bob["miss_positions"] if m["context"].endswith("-30T22:4"))
    assert (miss["prompt_token"], miss["cached_token"], miss["count"]) == ("2", "1", 1)
