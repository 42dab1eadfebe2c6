"""Where every prompt token went, as `prefixlab serve` answers it (docs/design.md §15): a scripted
session on a real server (free port, the bundled model, the real openai client)."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from app.replay.record import save_session_trace
from app.replay.results import ReplayConfig
from app.replay.simulate import replay
from app.replay.trace import open_trace
from engine.token_parts import KEYS, add_parts, zero_totals
from tests.serve_helpers import scheduler_on, start_server, wait_idle

pytestmark = pytest.mark.model
ROWS = 4
SYSTEM = "You are the concierge of the Grand Hotel. Breakfast is served from seven to ten. Be brief."
OTHERS = ["Zebras graze at dawn on the savanna near the river bend, far from any hotel.",
          "Quantum dots glow red under ultraviolet light in the physics laboratory basement.",
          "Old sailors mend their nets on the pier while gulls circle the fishing boats."]


def answer(client, question: str, system: str = SYSTEM, salt: str | None = None, stream: bool = False):
    """One chat request; the completion (the streamed usage chunk when streaming)."""
    extra = {"cache_salt": salt} if salt else None
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    if not stream:
        return client.chat.completions.create(model="m", max_tokens=6, messages=messages, extra_body=extra)
    chunks = list(client.chat.completions.create(model="m", max_tokens=6, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=extra))
    return chunks[-1]


def ask(client, question: str, system: str = SYSTEM, salt: str | None = None, stream: bool = False):
    """One chat request; its usage."""
    return answer(client, question, system, salt, stream).usage


def parts_of(usage) -> dict:
    """The usage's `prefixlab` object, checked to add up to the prompt."""
    p = usage.model_extra["prefixlab"]
    tokens = p["tokens"]
    assert list(tokens) == list(KEYS)
    assert sum(v for k, v in tokens.items() if k != "disk") == usage.prompt_tokens, p
    assert min(tokens.values()) >= 0 and tokens["disk"] <= tokens["cached"]
    assert usage.prompt_tokens_details.cached_tokens == tokens["cached"] + tokens["lent"]
    return p


@pytest.fixture(scope="module")
def served(real_model):
    srv = start_server(scheduler_on(real_model, page_rows=ROWS, max_streams=1))
    yield srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    srv.stop()


def test_a_session_cold_shared_repeated_and_salted(served, tmp_path):
    srv, client = served
    first = answer(client, "When is breakfast?")
    cold = parts_of(first.usage)
    assert cold["tokens"]["new"] == sum(cold["tokens"].values())
    assert (cold["diverged_at"], cold["diverged_from"]) == (None, None)
    first_id = first.id                                     # named by the id its client was given

    usage = ask(client, "Where is the pool?")
    shared = parts_of(usage)
    t, at = shared["tokens"], shared["diverged_at"]
    assert shared["diverged_from"] == first_id
    assert t["cached"] == at // ROWS * ROWS > 0            # the whole shared pages
    assert t["rounding"] == at - t["cached"] > 0            # it departs inside a page
    assert t["new"] == usage.prompt_tokens - at

    usage = ask(client, "Where is the pool?", stream=True)  # an exact repeat, streamed
    repeat = parts_of(usage)["tokens"]
    assert repeat["cached"] + repeat["cap"] == usage.prompt_tokens and repeat["cap"] >= 1

    # the same prompt under another cache_salt: that tenant is told all new, nothing of the others
    usage = ask(client, "Where is the pool?", salt="tenant-2")
    salted = parts_of(usage)
    assert salted["tokens"]["new"] == usage.prompt_tokens
    assert (salted["diverged_at"], salted["diverged_from"]) == (None, None)
    wait_idle(srv)
    sch = srv.engine.scheduler
    operator = sch.records()[-1]                             # the operator's view counts them isolated
    assert operator.parts.isolated == operator.parts.total - operator.parts.cap - operator.parts.rounding > 0
    assert isinstance(operator.diverged_from, int)          # the operator's view: the scheduler's id
    # a replay of the session's trace (two namespaces) counts them the same
    save_session_trace(str(tmp_path / "session.jsonl"), sch)
    replayed = replay(open_trace(str(tmp_path / "session.jsonl")), ReplayConfig(page_rows=ROWS)).parts
    recorded = zero_totals()
    for r in sch.records():
        add_parts(recorded, r.parts)
    assert replayed["isolated"] == recorded["isolated"] == operator.parts.isolated
    assert replayed == recorded

    # /metrics: tokens by part, isolated folded into new (no --metrics-isolated)
    text = httpx.get(srv.url + "/metrics").text
    line = re.compile(r'prefixlab_prompt_tokens_total\{part="(\w+)"\} (\d+)')
    counted = {m[1]: int(m[2]) for m in line.finditer(text)}
    assert "isolated" not in counted and counted["new"] >= usage.prompt_tokens
    served_prompts = sum(r.n_prompt for r in srv.engine.scheduler.records())
    assert sum(counted.values()) == served_prompts


def test_evicted_names_the_budget_and_the_disk_tier_brings_pages_back(real_model):
    for disk in (0, 400):
        srv = start_server(scheduler_on(real_model, page_rows=ROWS, max_streams=1, cache_pages=12,
                                        disk_tier_pages=disk))
        try:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
            parts_of(ask(client, "When is breakfast?"))
            for system in OTHERS:                            # distinct prompts push it out
                parts_of(ask(client, "Tell me more.", system=system))
            usage = ask(client, "When is breakfast?")
            again = parts_of(usage)
            if disk:
                assert again["tokens"]["disk"] > 0 and again["tokens"]["evicted"] == 0
            else:
                assert again["tokens"]["evicted"] > 0 and again["tokens"]["disk"] == 0
                assert again["evicted_by"] == {"cause": "budget", "budget_pages": 12}
                wait_idle(srv)
                assert "budget of 12 pages" in srv.engine.scheduler.records()[-1].evicted_by.describe()
        finally:
            srv.stop()


def test_metrics_fold_isolated_into_new_unless_asked():
    from types import SimpleNamespace

    from app.serve.metrics import TtftHistogram
    from engine.token_parts import TokenParts

    record = SimpleNamespace(ttft_s=0.1, n_prompt=20, parts=TokenParts(cached=8, disk=4, isolated=8, new=4))
    finish = SimpleNamespace(reason="stop", record=record)
    for show, expect in ((False, {"cached": 8, "isolated": None, "new": 12}),
                         (True, {"cached": 8, "isolated": 8, "new": 4})):
        h = TtftHistogram(show_isolated=show)
        h.observe(finish)
        text = "\n".join(h.lines())
        for part, n in expect.items():
            line = f'prefixlab_prompt_tokens_total{{part="{part}"}}'
            assert (f"{line} {n}" in text) if n is not None else line not in text, (show, part)
        assert "prefixlab_prompt_tokens_from_disk_total 4" in text


def test_the_serve_command_takes_metrics_isolated():
    import argparse

    from app.serve.cli import add_parser
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert parser.parse_args(["serve", "--metrics-isolated"]).metrics_isolated is True
    assert parser.parse_args(["serve"]).metrics_isolated is False
