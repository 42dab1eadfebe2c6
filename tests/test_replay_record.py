"""A recorded scheduler session, replayed at its own settings, gives its own hits exactly."""

from __future__ import annotations

import json

import pytest

from app.cli import main
from app.replay.record import save_session_trace
from app.replay.results import ReplayConfig
from app.replay.simulate import replay
from app.replay.trace import open_trace
from engine import SamplingParams
from engine.loop import EngineLoop
from engine.scheduler import Scheduler, SchedulerSettings

SYSTEM = "You are a terse assistant for a hardware store. Answer in one short sentence."
QUESTIONS = ["Do you sell hammers?", "Where are the nails?", "Do you cut keys?", "Are you open on Sunday?",
             "Do you rent ladders?", "Can I return paint?"]


def session(model, settings: SchedulerSettings) -> Scheduler:
    """Six questions sharing a system prompt (three streams at a time), a cancelled one, then a
    three-turn conversation: hits on the system prompt and on each turn's history."""
    loop = EngineLoop(model, settings)
    sch = loop.scheduler
    greedy = SamplingParams(temperature=0.0)
    for q in QUESTIONS:
        loop.submit_now(system=SYSTEM, user=q, sampling=greedy, max_new_tokens=6)
    doomed = loop.submit_now(system=SYSTEM, user="never mind", sampling=greedy, max_new_tokens=6)
    sch.cancel(doomed)
    loop.run_until_done()
    for turn in ("Hello!", "What do you sell?", "Thanks, bye."):
        loop.submit_now(system=SYSTEM, user=turn, conversation_id="chat", sampling=greedy, max_new_tokens=5,
                   namespace="chat")
        loop.run_until_done()
    return sch


@pytest.mark.parametrize("settings", [
    SchedulerSettings(max_streams=3, chunk_tokens=16, page_rows=4),
    SchedulerSettings(max_streams=2, chunk_tokens=8, page_rows=8),
    # A budget: evictions depend on when each request attached and donated (replayed one
    # after the other instead, this session saves 336 tokens, not 504).
    SchedulerSettings(max_streams=3, chunk_tokens=16, page_rows=4, cache_pages=12),
], ids=["rows4", "rows8", "rows4-budget12"])
def test_replay_of_a_recorded_session_reproduces_its_hits(tiny_model, tmp_path, settings):
    sch = session(tiny_model, settings)
    path = str(tmp_path / "session.jsonl")
    assert save_session_trace(path, sch, tiny_model.name) == 10
    src = open_trace(path)
    assert src.format == "prefixlab" and src.header.page_rows == settings.page_rows
    assert src.header.settings["max_streams"] == settings.max_streams
    r = replay(src, ReplayConfig(budget=settings.cache_pages or None))  # the session's own settings
    live_hits = sch.cache.counters.hits
    assert live_hits >= 6 and sch.prefill_saved > 0  # the system prompt and the turns did hit
    assert (r.hits, r.tokens_saved) == (live_hits, sch.prefill_saved)
    assert r.requests == 9  # the cancelled request never ran
    assert r.blocks_hit == sch.cache.counters.hit_pages


def test_recorded_trace_holds_what_each_request_did(tiny_model, tmp_path):
    sch = session(tiny_model, SchedulerSettings(max_streams=3, chunk_tokens=16, page_rows=4))
    path = tmp_path / "session.jsonl"
    save_session_trace(str(path), sch)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    header, reqs = lines[0], lines[1:]
    assert header["format"] == "prefixlab.trace/1" and header["page_rows"] == 4
    ran = [r for r in reqs if "admitted_s" in r]
    assert len(ran) == 9 and [r["admitted_s"] for r in ran] == sorted(r["admitted_s"] for r in ran)
    for r in ran:
        assert r["donated"][:len(r["prompt"])] == r["prompt"]  # a session donates its prompt and more
        assert r["finish_s"] >= r["admitted_s"] >= r["arrival_s"]
    turns = [r for r in ran if r.get("namespace") == "chat"]
    assert len(turns) == 3
    for before, after in zip(turns, turns[1:]):  # each turn extends the last one's donation
        assert after["prompt"][:len(before["donated"])] == before["donated"]
    assert reqs[-1]["input_length"] and "admitted_s" not in reqs[-1]  # the cancelled one: last


def test_run_writes_a_trace_and_its_redacted_form(tiny_gguf_path, tmp_path, capsys):
    trace, redacted = tmp_path / "t.jsonl", tmp_path / "r.jsonl"
    base = ["run", "--model", tiny_gguf_path, "--system", SYSTEM, "--prompt", "Do you sell hammers?",
            "--prompt", "Where are the nails?", "--max-new", "4", "--temp", "0", "--page-rows", "4",
            "--quiet"]
    assert main(base + ["--trace", str(trace)]) == 0
    assert main(base + ["--trace", str(redacted), "--redact"]) == 0
    assert "wrote" in capsys.readouterr().out
    full = open_trace(str(trace))
    rows = [json.loads(line) for line in redacted.read_text().splitlines()]
    assert [set(r) for r in rows] == [{"timestamp", "input_length", "output_length", "hash_ids"}] * 2
    assert "prompt" not in redacted.read_text()
    prompts = [r.prompt for r in full]
    assert [r["input_length"] for r in rows] == [len(p) for p in prompts]
    assert [len(r["hash_ids"]) for r in rows] == [-(-len(p) // 4) for p in prompts]
    # The shared system prompt: the same leading block ids in both requests.
    shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b) // 4
    assert shared > 0 and rows[0]["hash_ids"][:shared] == rows[1]["hash_ids"][:shared]
    assert rows[0]["hash_ids"][shared:] != rows[1]["hash_ids"][shared:]
