"""`prefixlab advise`: the hosted caches' rules on a chat log, where prompts diverge, what a fix buys."""

from __future__ import annotations

import datetime
import json
import os

import pytest

from app.advise.advisor import Tokenizers, advise
from app.advise.rules import DEFAULT_RULES, PROVIDER_DIR, RulesError, load_rules, resolve_rules
from app.advise.traffic import read_traffic
from app.cli import main
from app.replay.trace import TraceError

RULES = " ".join(f"Rule {i}: answer politely about tools, paint, lumber and garden supplies, item {i}."
                 for i in range(90))  # ~1,900 tokens: past every provider's minimum
START = datetime.datetime(2026, 11, 29, 10, 15, 3)
STAMP_AT = len("Current time: ")


def _write(path, bodies) -> str:
    path.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    return str(path)


def _ask(k: int, system: str, at: datetime.datetime, **extra) -> dict:
    return {"model": "gpt-4o", "timestamp": int(at.timestamp() * 1000), **extra,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"Question {k}: what glue works on wood?"}]}


def timestamp_log(tmp_path, n: int = 12) -> str:
    """A chat log whose system prompt starts with the time of the request (37 s apart)."""
    bodies = []
    for k in range(n):
        at = START + datetime.timedelta(seconds=37 * k)
        bodies.append(_ask(k, f"Current time: {at.isoformat()}Z. You are a store assistant. {RULES}", at))
    return _write(tmp_path / "chat.jsonl", bodies)


def _advice(real_model, path, rules=None) -> dict:
    return advise(path, read_traffic(path), resolve_rules(rules), Tokenizers(real_model.tokenizer))


def test_a_timestamp_at_the_start_is_found_and_its_fix_priced(real_model, tmp_path):
    path = timestamp_log(tmp_path)
    out = tmp_path / "advice.json"
    html = tmp_path / "advice.html"
    assert main(["advise", path, "--json", str(out), "--report", str(html)]) == 0
    advice = json.loads(out.read_text())
    assert [r["rules"]["name"] for r in advice["rule_sets"]] == sorted(DEFAULT_RULES, key=DEFAULT_RULES.index)

    top = advice["groups"][0]
    assert (top["message"], top["role"], top["field"], top["kind"]) == (0, "system", "content", "timestamp")
    assert (top["start"], top["end"]) == (STAMP_AT, STAMP_AT + len("2026-11-29T10:15:03Z"))
    assert top["count"] == 11 and top["summary"].startswith("11 of 12 requests diverge in message 0 (system) "
                                                            f"at characters {STAMP_AT}-{STAMP_AT + 19}")
    assert top["example"]["text"] == "2026-11-29T10:21:50Z"  # the last request's time

    openai_rules = next(r for r in advice["rule_sets"] if r["rules"]["name"] == "openai")
    assert openai_rules["totals"]["token_hit_ratio"] < 0.05
    assert openai_rules["totals"]["saved"] == 0
    after = {r["name"]: r["after"] for r in advice["what_if"]["rule_sets"]}
    assert after["openai"]["token_hit_ratio"] > 0.8
    assert after["openai"]["cost_with"] < openai_rules["totals"]["cost_with"]
    assert "to the end of the last user message" in advice["what_if"]["fix"]
    text = html.read_text()
    assert "<mark>2026-11-29T10:21:50Z</mark>" in text and "What a fix buys" in text


def test_cached_tokens_follow_from_the_common_prefix_by_each_rules_formula(real_model, tmp_path):
    advice = _advice(real_model, timestamp_log(tmp_path, n=4))
    fixed = [json.loads(line) for line in (tmp_path / "chat.jsonl").read_text().splitlines()]
    for body in fixed:  # the same traffic without the timestamp: now there are hits to check
        body["messages"][0]["content"] = f"You are a store assistant. {RULES}"
    advice = _advice(real_model, _write(tmp_path / "fixed.jsonl", fixed))
    hits = 0
    for rs in advice["rule_sets"]:
        rules = rs["rules"]
        for k, row in enumerate(rs["requests"]):
            n = row["common_prefix_tokens"]
            g = rules["granularity_tokens"]
            expect = 0 if n < rules["min_prefix_tokens"] else n // g * g
            if rules["behaviour"] == "anthropic-breakpoints":
                expect = 0  # no cache_control mark: nothing written, nothing read
            elif rules["behaviour"] == "deepseek-units" and k == 1:  # the longest whole stored unit: a
                expect = n // rules["unit_interval_tokens"] * rules["unit_interval_tokens"]  # 64-token step
            # (from the third request on, the common prefix request 2 found is a stored unit: n)
            assert row["cached_tokens"] == expect, rules["name"]
            hits += row["cached_tokens"] > 0
        assert rs["requests"][0]["cached_tokens"] == 0  # nothing earlier to match
    assert hits >= 4 * 3
    # what is left to differ is each request's own question: expected, nothing to fix
    assert advice["groups"] and all(g["expected"] and g["role"] == "user" for g in advice["groups"])
    assert advice["what_if"] is None


def test_a_request_after_more_than_ttl_of_silence_is_cached_zero(real_model, tmp_path):
    system = f"You are a store assistant. {RULES}"
    gaps = [0, 30, 30 + 601, 30 + 601 + 30]  # seconds; OpenAI's ttl is 600
    bodies = [_ask(k, system, START + datetime.timedelta(seconds=s)) for k, s in enumerate(gaps)]
    advice = _advice(real_model, _write(tmp_path / "gaps.jsonl", bodies), "openai,deepseek")
    openai_rows, deepseek_rows = (rs["requests"] for rs in advice["rule_sets"])
    assert [r["cached_tokens"] > 0 for r in openai_rows] == [False, True, False, True]
    assert openai_rows[2]["common_prefix_tokens"] == 0
    assert [r["cached_tokens"] > 0 for r in deepseek_rows] == [False, True, True, True]  # ttl 4 hours


def test_breakpoints_cache_only_up_to_a_cache_control_mark(real_model, tmp_path):
    system = [{"type": "text", "text": f"You are a store assistant. {RULES}",
               "cache_control": {"type": "ephemeral"}}]
    bodies = [_ask(k, "", START + datetime.timedelta(seconds=10 * k)) for k in range(3)]
    for b in bodies[1:]:
        b["messages"][0]["content"] = system
    bodies[0]["messages"][0]["content"] = system
    advice = _advice(real_model, _write(tmp_path / "marks.jsonl", bodies), "anthropic,prefixlab")
    anthropic_rows, openai_rows = (rs["requests"] for rs in advice["rule_sets"])  # the same tokens
    assert anthropic_rows[0]["written_tokens"] > 1024 and anthropic_rows[0]["cached_tokens"] == 0
    mark = anthropic_rows[1]["cached_tokens"]
    assert mark > 1024 and mark == anthropic_rows[2]["cached_tokens"]
    assert openai_rows[1]["common_prefix_tokens"] > mark  # without breakpoints: up to the user's question
    assert anthropic_rows[1]["written_tokens"] == 0
    totals = advice["rule_sets"][0]["totals"]
    price = advice["rule_sets"][0]["rules"]["price_per_million"]
    expect = sum((r["prompt_tokens"] - r["cached_tokens"]) * price["input"]
                 + r["cached_tokens"] * price["cached_input"]
                 + r["written_tokens"] * (price["cache_write"] - price["input"])
                 for r in anthropic_rows) / 1e6
    assert totals["cost_with"] == pytest.approx(expect, abs=1e-6)


def test_reordered_tools_are_named(real_model, tmp_path):
    tools = [{"type": "function", "function": {"name": n, "parameters": {}}}
             for n in ("paint", "glue", "saw")]
    bodies = [_ask(k, f"You are a store assistant. {RULES}", START + datetime.timedelta(seconds=k),
                   tools=tools[k % 3:] + tools[:k % 3]) for k in range(3)]
    advice = _advice(real_model, _write(tmp_path / "tools.jsonl", bodies), "openai")
    top = advice["groups"][0]
    assert (top["field"], top["kind"], top["count"]) == ("tools", "reordered", 2)
    result = advice["what_if"]["rule_sets"][0]
    assert result["before"]["token_hit_ratio"] < 0.05
    assert result["after"]["token_hit_ratio"] > 0.6  # 2 of 3 requests hit once the tools keep one order


# --- hostile input --------------------------------------------------------------------------


def test_a_rules_file_with_a_negative_minimum_is_refused_by_file_and_field(tmp_path, capsys):
    bad = tmp_path / "mine.toml"
    good = open(os.path.join(PROVIDER_DIR, "openai.toml")).read()
    bad.write_text(good.replace("min_prefix_tokens = 1024", "min_prefix_tokens = -5"))
    with pytest.raises(RulesError, match=r"mine.toml: field 'min_prefix_tokens' is negative: -5"):
        load_rules(str(bad))
    with pytest.raises(SystemExit, match="mine.toml: field 'min_prefix_tokens' is negative"):
        main(["advise", str(tmp_path / "any.jsonl"), "--rules", str(bad)])
    bad.write_text(good.replace("cached_input = 1.25", "cached_input = \"cheap\""))
    with pytest.raises(RulesError, match=r"field 'price_per_million.cached_input' must be a number"):
        load_rules(str(bad))
    bad.write_text("min_prefix = 3\n" + good)
    with pytest.raises(RulesError, match=r"field 'min_prefix' is unknown"):
        load_rules(str(bad))
    bad.write_text(good.replace('as_of = "2026-12-04"', 'as_of = "last week"'))
    with pytest.raises(RulesError, match=r"field 'as_of' must be a date"):
        load_rules(str(bad))
    with pytest.raises(RulesError, match="unknown rule set 'opneai'"):
        resolve_rules("opneai")
    for name in DEFAULT_RULES:  # every shipped file loads and says when and where from
        r = resolve_rules(name)[0]
        assert r.as_of and r.source


def test_bad_trace_lines_are_named(tmp_path):
    ok = json.dumps(_ask(0, "hello", START))
    (tmp_path / "nomsg.jsonl").write_text(ok + "\n" + json.dumps({"model": "gpt-4o", "timestamp": 5}) + "\n")
    with pytest.raises(TraceError, match=r"nomsg.jsonl, line 2: no 'messages'"):
        read_traffic(str(tmp_path / "nomsg.jsonl"))
    with open(tmp_path / "huge.jsonl", "w") as fh:
        fh.write(ok + "\n")
        fh.write(json.dumps({"messages": [{"role": "user", "content": "x" * (20 << 20)}]}) + "\n")
    with pytest.raises(TraceError, match=r"huge.jsonl, line 2: the line is over 16 MiB"):
        read_traffic(str(tmp_path / "huge.jsonl"))
    (tmp_path / "roles.jsonl").write_text(json.dumps({"messages": [{"content": "no role"}]}) + "\n")
    with pytest.raises(TraceError, match=r"line 1, message 0: 'role' must be a string"):
        read_traffic(str(tmp_path / "roles.jsonl"))
    refused = {"timestamp": 1, "endpoint": "/v1/chat/completions", "status": 500,
               "body": _ask(0, "hi", START)}
    (tmp_path / "refused.jsonl").write_text(json.dumps(refused) + "\n")
    with pytest.raises(TraceError, match=r"no requests \(1 proxy records skipped: the upstream answered 500"):
        read_traffic(str(tmp_path / "refused.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(SystemExit, match="empty.jsonl: the trace has no requests"):
        main(["advise", str(tmp_path / "empty.jsonl")])


def test_a_prefixlab_token_trace_is_advised_on_its_decoded_text(real_model, tmp_path):
    from app.replay.trace import TraceHeader, TraceRequest, write_trace
    tok = real_model.tokenizer
    bodies = [json.loads(line) for line in open(timestamp_log(tmp_path, n=4))]
    path = str(tmp_path / "session.jsonl")
    write_trace(path, TraceHeader(page_rows=16, model=real_model.name),
                [TraceRequest(arrival_s=b["timestamp"] / 1000, input_length=0, output_length=4,
                              prompt=tok.encode(tok.render_chat(b["messages"]))) for b in bodies])
    advice = _advice(real_model, path, "openai")
    top = advice["groups"][0]
    assert (top["field"], top["kind"], top["count"]) == ("prompt", "timestamp", 3)
    assert top["example"]["text"] == "2026-11-29T10:16:54Z"
    (tmp_path / "mooncake.jsonl").write_text('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n')
    with pytest.raises(TraceError, match="hash-id trace has block hashes, not prompts"):
        read_traffic(str(tmp_path / "mooncake.jsonl"))


def _lcp(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_the_simulation_equals_the_definition_by_brute_force():
    """Random prompts sharing prefixes, random silences: L is the longest common prefix with a
    prompt last used at most ttl before (a hit refreshing the prompt it matched), exactly."""
    import random

    from app.advise.prompts import Prompt
    from app.advise.rules import Prices, RuleSet
    from app.advise.simulate import simulate
    from app.advise.traffic import Request
    rng = random.Random(7)
    rules = RuleSet("t", "2026-01-01", "test", min_prefix_tokens=3, granularity_tokens=2, ttl_seconds=10.0,
                    breakpoints=False, tokenizer="model", prices=Prices(1.0, 0.5, 1.0, 2.0))
    for _ in range(30):
        bases = [[rng.randrange(5) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
        tokens = [rng.choice(bases)[:rng.randrange(0, 12)] + [rng.randrange(5)] * rng.randrange(1, 6)
                  for _ in range(25)]
        times = [0.0]
        for _ in tokens[1:]:
            times.append(times[-1] + rng.choice([0.5, 3.0, 11.0]))
        got = simulate(rules, [Request(line=i + 1, arrival_s=t) for i, t in enumerate(times)],
                       [Prompt("", p, []) for p in tokens])
        last: list[float] = []
        for i, (p, now) in enumerate(zip(tokens, times)):
            alive = [j for j in range(i) if now - last[j] <= rules.ttl_seconds]
            shared = {j: _lcp(p, tokens[j]) for j in alive}
            best = max(shared.values(), default=0)
            assert got[i].common_prefix_tokens == best
            assert got[i].cached_tokens == (0 if best < 3 else best // 2 * 2)
            if got[i].cached_tokens:  # the hit refreshes the most recently used prompt it matched
                j = max((j for j in alive if shared[j] == best), key=lambda j: (last[j], j))
                last[j] = now
            last.append(now)


@pytest.mark.parametrize("a, b, kind, value", [
    ("Now: 2026-11-29T10:15:03Z. Hi", "Now: 2026-11-29T10:16:41Z. Hi", "timestamp", "2026-11-29T10:15:03Z"),
    ("Today is Monday, 30 Nov 2026. Be brief.", "Today is Sunday, 29 Nov 2026. Be brief.", "timestamp",
     "Monday, 30 Nov 2026"),
    ("at 1764410103 sharp", "at 1764410164 sharp", "timestamp", "1764410103"),
    ("req 3f2b8c1e-9d4a-4e21-8b7f-0c5d6e7f8a9b ok", "req 0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d ok", "id",
     "3f2b8c1e-9d4a-4e21-8b7f-0c5d6e7f8a9b"),
    ("trace a3f9c2e1b7d4 end", "trace 9b8e7d6c5a4f end", "id", "a3f9c2e1b7d4"),
    ("You have 12 credits left.", "You have 7 credits left.", "number", "12"),
    ("Be  brief.", "Be brief.", "whitespace", " "),
    ('{"b": 1, "a": 2}', '{"a": 2, "b": 1}', "reordered", '{"b": 1, "a": 2}'),
    ("You are Ann, a guide.", "You are Bob, a guide.", "other", "Ann"),
])
def test_a_difference_is_classified_with_its_whole_value(a, b, kind, value):
    from app.advise.divergence import classify
    got, start, end = classify(a, b)
    assert got == kind and a[start:end].startswith(value)


def test_a_rule_set_may_name_its_own_tokenizer(real_model, tmp_path, tiny_gguf_path):
    mine = tmp_path / "mine.toml"
    text = open(os.path.join(PROVIDER_DIR, "prefixlab.toml")).read()
    mine.write_text(text.replace('name = "prefixlab"', 'name = "mine"')
                    .replace('tokenizer = "model"', f'tokenizer = "{tiny_gguf_path}"'))
    out = tmp_path / "a.json"
    log = timestamp_log(tmp_path, n=3)
    assert main(["advise", log, "--rules", f"prefixlab,{mine}", "--json", str(out)]) == 0
    ours, theirs = (rs["totals"]["prompt_tokens"] for rs in json.loads(out.read_text())["rule_sets"])
    import engine
    tok = {"model": real_model.tokenizer, "mine": engine.load_model(tiny_gguf_path).tokenizer}
    bodies = [json.loads(line) for line in open(log)]
    want = {k: sum(len(t.encode(t.render_chat(b["messages"]))) for b in bodies) for k, t in tok.items()}
    assert (ours, theirs) == (want["model"], want["mine"]) and ours != theirs


# --- round 3: one bad line or request is skipped and counted, rules files are bounded -----------------


def test_json_nested_deeply_in_a_line_is_skipped_and_counted(tmp_path):
    ok = json.dumps(_ask(0, "hello", START))
    deep = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path = tmp_path / "deep.jsonl"
    path.write_text(ok + "\n" + deep + "\n" + ok + "\n")
    skipped: list = []
    requests = read_traffic(str(path), skipped, strict=False)
    assert [r.line for r in requests] == [1, 3]
    assert skipped == [{"line": 2, "why": "not a trace line: JSON nested too deeply"}]
    with pytest.raises(TraceError, match=r"deep.jsonl, line 2: not a trace line: JSON nested too deeply"):
        read_traffic(str(path), strict=True)


def test_an_infinite_timestamp_is_refused(tmp_path):
    path = tmp_path / "inf.jsonl"
    stamp = str(int(START.timestamp() * 1000))
    path.write_text(json.dumps(_ask(0, "hello", START)) + "\n"
                    + json.dumps(_ask(1, "hello", START)).replace(stamp, "Infinity") + "\n")
    with pytest.raises(TraceError, match=r"inf.jsonl, line 2: 'timestamp' must be milliseconds >= 0 and "
                                         r"finite"):
        read_traffic(str(path))
    skipped: list = []
    assert [r.line for r in read_traffic(str(path), skipped, strict=False)] == [1]
    assert skipped[0]["line"] == 2 and "finite" in skipped[0]["why"]


def test_a_15_mb_request_is_skipped_with_one_line_not_the_whole_run(real_model, tmp_path, capsys):
    bodies = [_ask(0, f"You are a store assistant. {RULES}", START),
              {"model": "gpt-4o", "messages": [{"role": "user", "content": "x" * 15_000_000}]},
              _ask(1, f"You are a store assistant. {RULES}", START + datetime.timedelta(seconds=5))]
    path = _write(tmp_path / "rec.jsonl", bodies)
    out = tmp_path / "advice.json"
    assert main(["advise", path, "--rules", "openai", "--json", str(out)]) == 0
    said = capsys.readouterr().out
    assert "skipped line 2: the request's text is 15,000,0" in said and "1 line(s) skipped" in said
    advice = json.loads(out.read_text())
    assert advice["requests"] == 2 and [k["line"] for k in advice["skipped"]] == [2]
    with pytest.raises(SystemExit, match=r"rec.jsonl, line 2: the request's text is 15,000,0\d\d characters"):
        main(["advise", path, "--rules", "openai", "--strict"])


def test_a_price_past_the_limit_is_refused_by_field(tmp_path):
    good = open(os.path.join(PROVIDER_DIR, "openai.toml")).read()
    bad = tmp_path / "dear.toml"
    bad.write_text(good.replace("input = 2.50", "input = 1e308"))
    with pytest.raises(RulesError, match=r"dear.toml: field 'price_per_million.input' is 1e\+308, over the "
                                         r"limit of 100,000 USD per million tokens"):
        load_rules(str(bad))


def _advice_citing(source: str) -> dict:
    totals = {"requests": 1, "prompt_tokens": 10, "cached_tokens": 0, "token_hit_ratio": 0.0,
              "cost_without": 0.1, "cost_with": 0.1, "saved": 0.0}
    return {"trace": "t.jsonl", "requests": 1, "skipped": [], "groups": [], "what_if": None,
            "rule_sets": [{"rules": {"name": "mine", "as_of": "2026-01-01", "source": source},
                           "totals": totals}]}


@pytest.mark.parametrize("source", ["javascript:alert(document.cookie)", " JavaScript:alert(1)",
                                    "data:text/html,<script>alert(1)</script>", "java\tscript:alert(1)"])
def test_a_rules_source_that_is_no_web_address_is_plain_text_in_the_report(source):
    from app.advise.html import render_html
    page = render_html(_advice_citing(source))
    assert "<a " not in page and "<script>" not in page
    assert "alert(" in page  # shown, escaped, as text


def test_a_web_address_source_stays_a_link():
    from app.advise.html import render_html
    page = render_html(_advice_citing("https://example.com/docs?a=1&b='2'"))
    assert "<a href='https://example.com/docs?a=1&amp;b=&#x27;2&#x27;'>" in page
