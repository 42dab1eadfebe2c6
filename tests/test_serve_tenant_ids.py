"""A response never reveals another tenant's traffic (issue #46, docs/design.md §15): two API
keys interleave requests on a real server (free port, the bundled model, the real openai
client); tenant B's answers carry nothing derived from A's requests, and an answer's
`diverged_from` names the caller's own earlier completion by the id it was given."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from app.serve.server import CompletionIds
from tests.serve_helpers import scheduler_on, start_server, wait_idle

pytestmark = pytest.mark.model
ROWS = 4
KEYS = ["key-alice", "key-bob"]
SYSTEM = "You are the concierge of the Grand Hotel. Breakfast is served from seven to ten. Be brief."
QUESTIONS = ["When is breakfast?", "Where is the pool?", "Is there a gym?"]
# what uvicorn and Starlette write; a header that counts requests (a request id, a queue
# position) would be a new name here
HEADERS = {"date", "server", "content-length", "content-type", "transfer-encoding", "cache-control",
           "x-accel-buffering"}


def ask(client, question: str, stream: bool = False) -> dict:
    """One chat request: its id, usage and headers (the streamed usage chunk's when streaming)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    create = client.chat.completions.with_raw_response.create
    if stream:
        raw = create(model="m", max_tokens=2, temperature=0, messages=messages, stream=True,
                     stream_options={"include_usage": True})
        last = list(raw.parse())[-1]
        return {"id": last.id, "usage": last.usage.model_dump(), "headers": raw.headers}
    raw = create(model="m", max_tokens=2, temperature=0, messages=messages)
    body = raw.parse()
    return {"id": body.id, "usage": body.usage.model_dump(), "headers": raw.headers}


def session(srv, with_alice: bool) -> tuple[list[dict], list[dict]]:
    """Bob's three questions (the last streamed), each after Alice asks the same one (or not)."""
    alice, bob = (openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0) for key in KEYS)
    a, b = [], []
    for i, question in enumerate(QUESTIONS):
        if with_alice:
            a.append(ask(alice, question))
        b.append(ask(bob, question, stream=i == len(QUESTIONS) - 1))
    wait_idle(srv)
    return a, b


def own_view(answers: list[dict]) -> list[dict]:
    """What a tenant could compare between two worlds: its usage, its own ids as their index."""
    index = {r["id"]: i for i, r in enumerate(answers)}
    out = []
    for r in answers:
        usage = json.loads(json.dumps(r["usage"]))
        usage["prefixlab"]["diverged_from"] = index.get(usage["prefixlab"]["diverged_from"], "foreign")
        out.append(usage)
    return out


def test_a_tenant_sees_only_its_own_traffic(real_model):
    load = scheduler_on(real_model, page_rows=ROWS, max_streams=1)
    srv = start_server(load, api_keys=KEYS)
    try:
        a, b = session(srv, with_alice=True)
        operator = srv.engine.scheduler.records()
    finally:
        srv.stop()
    srv = start_server(load, api_keys=KEYS)
    try:
        _, bob_alone = session(srv, with_alice=False)
    finally:
        srv.stop()

    # Alice's second and third prompts name her first answer (the shared system prompt)
    assert a[0]["usage"]["prefixlab"]["diverged_from"] is None
    assert [r["usage"]["prefixlab"]["diverged_from"] for r in a[1:]] == [a[0]["id"], a[0]["id"]]
    # Bob asked exactly what Alice had: he is told all new and nothing of her
    first = b[0]["usage"]
    assert first["prefixlab"]["tokens"]["new"] == first["prompt_tokens"]
    assert (first["prefixlab"]["diverged_at"], first["prefixlab"]["diverged_from"]) == (None, None)
    assert [r["usage"]["prefixlab"]["diverged_from"] for r in b[1:]] == [b[0]["id"], b[0]["id"]]
    # ... while the operator's records name the scheduler's requests across both tenants
    assert operator[1].diverged_from == operator[0].id and operator[1].parts.isolated > 0

    # Bob's answers are the same whether or not Alice sent anything: usage, ids, headers
    assert own_view(b) == own_view(bob_alone)
    alice_ids = {r["id"] for r in a}
    for r in b:
        assert not any(i in json.dumps(r["usage"]) for i in alice_ids)
        assert set(r["headers"]) <= HEADERS, r["headers"]

    # completion ids are random, not a count of every tenant's requests
    ids = [r["id"] for pair in zip(a, b) for r in pair]
    assert all(re.fullmatch(r"chatcmpl-[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == len(ids)
    values = [int(i.removeprefix("chatcmpl-"), 16) for i in ids]
    assert all(abs(x - y) > 2**32 for x, y in zip(values, values[1:])), ids


def test_metrics_count_every_tenant_so_only_the_operator_reads_them(real_model):
    load = scheduler_on(real_model, page_rows=ROWS, max_streams=1)
    for metrics_key in ("ops-key", None):
        srv = start_server(load, api_keys=KEYS, metrics_key=metrics_key)
        try:
            ask(openai.OpenAI(base_url=srv.url + "/v1", api_key=KEYS[0], max_retries=0), QUESTIONS[0])
            scrape = [httpx.get(srv.url + "/metrics", headers=auth) for auth in (
                {}, {"authorization": f"Bearer {KEYS[1]}"}, {"authorization": f"Bearer {metrics_key}"})]
        finally:
            srv.stop()
        for r in scrape[:2] + ([] if metrics_key else scrape[2:]):   # a tenant never reads Alice's
            assert r.status_code == 401 and "requests_finished" not in r.text
            assert "--metrics-key" in r.json()["error"]["message"]
        if metrics_key:
            assert scrape[2].status_code == 200
            assert 'prefixlab_requests_finished_total{finish_reason="length"} 1' in scrape[2].text


def test_the_serve_command_takes_a_metrics_key():
    import argparse

    from app.serve.cli import add_parser
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert parser.parse_args(["serve", "--metrics-key", "k"]).metrics_key == "k"
    assert parser.parse_args(["serve"]).metrics_key is None


def test_completion_ids_are_bounded_per_namespace_and_per_scheduler():
    class Scheduler:   # any object: the books only ask which scheduler the ids are of
        pass

    sch, books = Scheduler(), CompletionIds(size=2)
    for rid in (1, 2, 3):
        books.add(sch, rid, "key-a", f"chatcmpl-{rid}")
    assert books.name(sch, 1, "key-a") is None                  # past the bound: null
    assert books.name(sch, 2, "key-a") == "chatcmpl-2"
    assert books.name(sch, 2, "key-b") is None                  # never another namespace's
    assert books.name(sch, None, "key-a") is None
    books.add(sch, 4, "key-a", "chatcmpl-4")                    # 2 was named last: 3 goes
    assert (books.name(sch, 3, "key-a"), books.name(sch, 2, "key-a")) == (None, "chatcmpl-2")
    assert books.name(Scheduler(), 2, "key-a") is None          # a new scheduler counts from 1 again
