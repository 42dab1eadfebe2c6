"""Each provider's cache as its documentation describes it: a test per documented example
(resources/providers/*.toml cite the pages)."""

from __future__ import annotations

import datetime
import json
import os
import tomllib

import pytest

from app.advise.advisor import Tokenizers, advise
from app.advise.rules import PROVIDER_DIR, resolve_rules, shipped
from app.advise.traffic import read_traffic

SYSTEM = " ".join(f"Rule {i}: answer politely about tools, paint, lumber and garden supplies, item {i}."
                  for i in range(90))  # ~1,900 tokens: past Sonnet's 1,024, under Haiku 4.5's 4,096
START = datetime.datetime(2026, 11, 29, 10, 15, 3)
MARK = {"type": "ephemeral"}


def _ms(seconds: float) -> int:
    return int((START + datetime.timedelta(seconds=seconds)).timestamp() * 1000)


def _text(text: str, mark: dict | None = None) -> dict:
    return {"type": "text", "text": text, **({"cache_control": mark} if mark else {})}


def _body(at: float, messages: list, system_mark: dict | None = None, model: str = "claude-sonnet-4-5",
          **extra) -> dict:
    """A Messages API body (the system prompt as blocks), arriving `at` seconds after START."""
    return {"model": model, "timestamp": _ms(at), "max_tokens": 100,
            "system": [_text(f"You are a store assistant. {SYSTEM}", system_mark)], "messages": messages,
            **extra}


def _rows(real_model, tmp_path, bodies, rules="anthropic", name="t.jsonl") -> dict:
    path = tmp_path / name
    path.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    advice = advise(str(path), read_traffic(str(path)), resolve_rules(rules),
                    Tokenizers(real_model.tokenizer))
    return advice["rule_sets"][0]


def _conversation(turns: int, gap_s: float, mark: dict = MARK) -> list[dict]:
    """The documented multi-turn pattern: one breakpoint on the last user block, moving forward."""
    bodies, history = [], []
    for t in range(turns):
        history = [*history, {"role": "user", "content": [_text(f"Question {t}: which glue for oak?")]}]
        marked = [dict(m) for m in history]
        marked[-1] = {"role": "user", "content": [_text(history[-1]["content"][0]["text"], mark)]}
        bodies.append(_body(t * gap_s, marked))
        history.append({"role": "assistant", "content": f"Answer {t}: a PVA glue, clamped overnight."})
    return bodies


def test_one_breakpoint_moving_forward_reads_the_previous_turn_and_writes_only_the_new_part(real_model,
                                                                                             tmp_path):
    rs = _rows(real_model, tmp_path, _conversation(4, 30.0))
    rows = rs["requests"]
    for r in rows:
        assert r["cache_read_tokens"] + r["cache_write_tokens"] + r["uncached_tokens"] == r["prompt_tokens"]
    marks = [r["cache_read_tokens"] + r["cache_write_tokens"] for r in rows]  # each turn's mark
    assert rows[0]["cache_read_tokens"] == 0 and rows[0]["cache_write_tokens"] > 1024
    for k in range(1, 4):
        assert rows[k]["cache_read_tokens"] == marks[k - 1]        # the previous turn's written prefix
        assert 0 < rows[k]["cache_write_tokens"] < 60              # only the new turn
    t = rs["totals"]
    assert t["cost_with"] < t["cost_without"] and t["saved"] > 0


def test_an_unmarked_request_then_a_marked_one_reads_nothing(real_model, tmp_path):
    ask = [{"role": "user", "content": "Which glue for oak?"}]
    rows = _rows(real_model, tmp_path, [_body(0, ask), _body(10, ask, MARK)])["requests"]
    assert [r["cache_read_tokens"] for r in rows] == [0, 0]
    assert rows[0]["cache_write_tokens"] == 0 and rows[1]["cache_write_tokens"] > 1024


def test_two_identical_marked_requests_arriving_together_both_write(real_model, tmp_path):
    ask = [{"role": "user", "content": "Which glue for oak?"}]
    rows = _rows(real_model, tmp_path, [_body(0, ask, MARK), _body(0, ask, MARK), _body(5, ask, MARK)])
    rows = rows["requests"]
    assert [r["cache_read_tokens"] for r in rows][:2] == [0, 0]
    assert rows[1]["cache_write_tokens"] == rows[0]["cache_write_tokens"] > 1024
    assert "still being written" in rows[1]["why"]
    assert rows[2]["cache_read_tokens"] == rows[0]["cache_write_tokens"]  # later: readable


def test_a_ten_minute_gap_reads_nothing_at_five_minutes_and_everything_at_one_hour(real_model, tmp_path):
    ask = [{"role": "user", "content": "Which glue for oak?"}]
    short = _rows(real_model, tmp_path, [_body(0, ask, MARK), _body(600, ask, MARK)], name="5m.jsonl")
    hour = {"type": "ephemeral", "ttl": "1h"}
    long = _rows(real_model, tmp_path, [_body(0, ask, hour), _body(600, ask, hour)], name="1h.jsonl")
    assert short["requests"][1]["cache_read_tokens"] == 0
    assert short["requests"][1]["parts"]["expired"] > 1024
    written = long["requests"][0]["cache_write_tokens"]
    assert long["requests"][1]["cache_read_tokens"] == written > 1024
    assert long["requests"][0]["cache_write_long_tokens"] == written
    price = long["rules"]["price_per_million"]
    assert price["cache_write_long"] == 2 * price["input"]  # a 1-hour write costs 2x input
    first = long["requests"][0]
    assert first["cost_with"] == pytest.approx((first["uncached_tokens"] * price["input"]
                                                + written * price["cache_write_long"]) / 1e6, abs=1e-8)


def test_a_top_level_cache_control_caches_like_a_mark_on_the_last_block(real_model, tmp_path):
    def turn(at, text, marked):
        return _body(at, [{"role": "user", "content": [_text(text, MARK if marked else None)]}],
                     **({} if marked else {"cache_control": MARK}))
    auto = _rows(real_model, tmp_path, [turn(0, "Which glue?", False), turn(9, "Which glue?", False)],
                 name="auto.jsonl")["requests"]
    mark = _rows(real_model, tmp_path, [turn(0, "Which glue?", True), turn(9, "Which glue?", True)],
                 name="mark.jsonl")["requests"]
    keys = ("cache_read_tokens", "cache_write_tokens", "uncached_tokens")
    assert [[r[k] for k in keys] for r in auto] == [[r[k] for k in keys] for r in mark]
    assert auto[1]["cache_read_tokens"] > 1024


def test_a_mark_on_a_tool_result_is_kept(real_model, tmp_path):
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "stock",
                                              "input": {"item": "glue"}}]}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "12 bottles of PVA glue in aisle 4."}
    first = [{"role": "user", "content": "Is there glue?"}, call,
             {"role": "user", "content": [{**result, "cache_control": MARK}]}]
    second = [*first[:2], {"role": "user", "content": [result, _text("And clamps?", MARK)]}]
    rows = _rows(real_model, tmp_path, [_body(0, first), _body(20, second)])["requests"]
    assert rows[1]["cache_read_tokens"] == rows[0]["cache_write_tokens"] > 1024


def test_a_mark_more_than_twenty_blocks_past_the_written_one_reads_nothing(real_model, tmp_path):
    first = [{"role": "user", "content": [_text("Start.", MARK)]}]
    blocks = [_text(f"Note {k}.") for k in range(25)]
    near = [{"role": "user", "content": [_text("Start."), *blocks[:10], _text("End.", MARK)]}]
    far = [{"role": "user", "content": [_text("Start."), *blocks, _text("End.", MARK)]}]
    rows = _rows(real_model, tmp_path, [_body(0, first), _body(10, near)], name="near.jsonl")["requests"]
    assert rows[1]["cache_read_tokens"] == rows[0]["cache_write_tokens"] > 1024
    rows = _rows(real_model, tmp_path, [_body(0, first), _body(10, far)], name="far.jsonl")["requests"]
    assert rows[1]["cache_read_tokens"] == 0 and rows[1]["parts"]["no_breakpoint"] > 1024


def test_haiku_4_5_needs_4096_tokens(real_model, tmp_path):
    ask = [{"role": "user", "content": "Which glue for oak?"}]
    bodies = [_body(at, ask, MARK, model="claude-haiku-4-5") for at in (0, 10)]
    rows = _rows(real_model, tmp_path, bodies)["requests"]
    assert all(r["cache_read_tokens"] == r["cache_write_tokens"] == 0 for r in rows)
    assert rows[1]["parts"]["below_minimum"] > 1024


def test_openai_overflow_past_15_a_minute_on_one_prefix_and_key_is_not_all_cached(real_model, tmp_path):
    bodies = [{"model": "gpt-4o", "timestamp": _ms(0.6 * k), "prompt_cache_key": "app",
               "messages": [{"role": "system", "content": f"You are a store assistant. {SYSTEM}"},
                            {"role": "user", "content": f"Question {k}: which glue for oak?"}]}
              for k in range(100)]
    rs = _rows(real_model, tmp_path, bodies, rules="openai")
    rows = rs["requests"]
    cold = [r for r in rows[1:] if r["cache_read_tokens"] == 0]
    assert all(r["cache_read_tokens"] > 1024 for r in rows[1:15])       # the first 15 a minute: home
    assert len(cold) >= 10 and all("overflow" in r["parts"] and "overflow machine" in r["why"] for r in cold)
    assert rs["totals"]["token_hit_ratio"] < 0.9
    assert "prompt_cache_key" in rs["note"] and "cold cache" in rs["note"]
    # at 10 a minute nothing overflows
    slow = [dict(b, timestamp=_ms(6.0 * k)) for k, b in enumerate(bodies[:20])]
    rows = _rows(real_model, tmp_path, slow, rules="openai", name="slow.jsonl")["requests"]
    assert all(r["cache_read_tokens"] > 1024 for r in rows[1:])


def test_openai_24_hour_retention(real_model, tmp_path):
    def ask(at, **extra):
        return {"model": "gpt-4o", "timestamp": _ms(at), **extra,
                "messages": [{"role": "system", "content": f"You are a store assistant. {SYSTEM}"},
                             {"role": "user", "content": "Which glue for oak?"}]}
    day = {"prompt_cache_retention": "24h"}
    rows = _rows(real_model, tmp_path, [ask(0), ask(3600)], rules="openai", name="a.jsonl")["requests"]
    assert rows[1]["cache_read_tokens"] == 0
    rows = _rows(real_model, tmp_path, [ask(0, **day), ask(3600, **day)], rules="openai")["requests"]
    assert rows[1]["cache_read_tokens"] > 1024


def test_deepseek_a_hit_needs_a_whole_stored_unit(real_model, tmp_path):
    """The guide's example 2: A+B, then A+C (no whole unit: 0, but A is detected and stored), then
    A+D reads A."""
    doc = "Report: " + " ".join(f"Quarter {k} revenue rose {k} percent on lumber." for k in range(60))
    def ask(at, q):
        return {"model": "deepseek-chat", "timestamp": _ms(at),
                "messages": [{"role": "user", "content": f"{doc}\n\n{q}"}]}
    rs = _rows(real_model, tmp_path, [ask(0, "Summarize it."), ask(5, "Give the margin."),
                                      ask(10, "List the risks.")], rules="deepseek")
    rows = rs["requests"]
    assert rs["rules"]["unit_interval_tokens"] == 64
    assert rows[1]["cache_read_tokens"] == rows[1]["common_prefix_tokens"] // 64 * 64  # fixed-interval units
    assert rows[2]["cache_read_tokens"] == rows[2]["common_prefix_tokens"] > rows[1]["cache_read_tokens"]


def test_every_rule_file_is_of_this_year_with_a_source_per_rule():
    for name in shipped():
        with open(os.path.join(PROVIDER_DIR, name + ".toml"), "rb") as fh:
            data = tomllib.load(fh)
        assert data["as_of"].startswith("2026"), name
        for rule in ("min_prefix_tokens", "ttl_seconds", "price_per_million"):
            assert rule in data["sources"], (name, rule)
        if data.get("behaviour", "prefix") != "prefix":
            assert "behaviour" in data["sources"], name
        assert data["unmodelled"], name
    gemini, mistral = resolve_rules("gemini,mistral")
    assert gemini.min_prefix_tokens == 2048 and gemini.prices.cached_input == pytest.approx(0.1 * 0.30)
    assert (mistral.granularity_tokens, mistral.prices.cached_input) == (64, pytest.approx(0.1 * 0.40))


def test_openai_counts_in_o200k_base(real_model, tmp_path):
    """A completion's text is counted exactly as o200k_base counts it ("hello world" is [24912, 2375])."""
    from app.advise.tokens import EncodingTokenizer
    enc = EncodingTokenizer("o200k_base")
    assert enc.encode("hello world") == [24912, 2375]
    assert EncodingTokenizer("cl100k_base").encode("hello world") == [15339, 1917]
    text = f"Current time: 2026-11-29T10:15:03Z. {SYSTEM}"
    rs = _rows(real_model, tmp_path, [{"model": "gpt-4o", "prompt": text}], rules="openai")
    ours = rs["requests"][0]["prompt_tokens"]
    assert ours == len(enc.encode(text)) != len(real_model.tokenizer.encode(text))
    assert rs["tokens"] == {"tokenizer": "o200k_base", "scaled_to_usage": None}


def test_a_provider_without_a_tokenizer_is_scaled_to_the_recordings_usage(real_model, tmp_path):
    ask = [{"role": "user", "content": "Which glue for oak?"}]
    bodies = [_body(0, ask, MARK), _body(10, ask, MARK)]
    plain = _rows(real_model, tmp_path, bodies, name="plain.jsonl")
    local = plain["requests"][0]["prompt_tokens"]
    for b in bodies:
        b["usage"] = {"input_tokens": 2 * local}  # the provider counted twice as many tokens
    rs = _rows(real_model, tmp_path, bodies, name="usage.jsonl")
    assert rs["tokens"]["scaled_to_usage"] == 2.0
    assert [r["prompt_tokens"] for r in rs["requests"]] == [2 * local, 2 * local]
    assert rs["requests"][1]["cache_read_tokens"] == 2 * plain["requests"][1]["cache_read_tokens"]
    assert plain["tokens"]["scaled_to_usage"] is None


def _hints(real_model, tmp_path, bodies, rules, name="h.jsonl") -> dict:
    from app.advise.hints import hints
    path = tmp_path / name
    path.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    requests, sets, toks = read_traffic(str(path)), resolve_rules(rules), Tokenizers(real_model.tokenizer)
    advice = advise(str(path), requests, sets, toks)
    return hints(advice, sets, requests, toks.prompts)


def test_the_advice_names_the_change_that_pays_most(real_model, tmp_path):
    ask = [{"role": "user", "content": "Which glue for oak?"}]
    gaps = [_body(k * 600, ask, MARK) for k in range(4)]  # every 10 minutes: past 5, within an hour
    line = _hints(real_model, tmp_path, gaps, "anthropic")["anthropic"]
    assert line.startswith("prompts expire between uses: the 1-hour lifetime") and '"ttl": "1h"' in line
    assert "0% -> " in line and "saved" in line
    system = {"role": "system", "content": f"You are a store assistant. {SYSTEM}"}
    busy = [{"model": "gpt-4o", "timestamp": _ms(0.6 * k), "prompt_cache_key": "app",
             "messages": [system, {"role": "user", "content": f"Question {k}: which glue for oak?"}]}
            for k in range(100)]
    line = _hints(real_model, tmp_path, busy, "openai", name="busy.jsonl")["openai"]
    assert "set prompt_cache_key per user or app (7 keys" in line and "saved" in line
    long_system = {"role": "system", "content": f"You are a store assistant. {SYSTEM} {SYSTEM}"}
    hourly = [{"model": "gemini-2.5-flash", "timestamp": _ms(k * 900),
               "messages": [long_system, {"role": "user", "content": f"Question {k}: which glue for oak?"}]}
              for k in range(12)]
    line = _hints(real_model, tmp_path, hourly, "gemini", name="g.jsonl")["gemini"]
    assert line.startswith("an explicit cache of the first") and "storage" in line


def test_a_far_moved_breakpoint_is_advised_a_second_one_on_the_system_prompt(real_model, tmp_path):
    """Each turn adds 25 blocks and marks only its end: past the 20-block lookback nothing is read;
    a mark on the system prompt as well would read it every turn."""
    bodies, content = [], []
    for t in range(3):
        content = [*content, *(_text(f"Log line {t}.{k}.") for k in range(25))]
        bodies.append(_body(30 * t, [{"role": "user", "content": [*content[:-1], _text(content[-1]["text"],
                                                                                        MARK)]}]))
    rs = _rows(real_model, tmp_path, bodies)
    assert [r["cache_read_tokens"] for r in rs["requests"]] == [0, 0, 0]
    line = _hints(real_model, tmp_path, bodies, "anthropic", name="far.jsonl")["anthropic"]
    assert line.startswith("add a cache_control breakpoint at the end of the system prompt")
    assert "saved" in line


def test_marks_on_images_count_and_only_four_marks_are_read(real_model, tmp_path):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    first = [{"role": "user", "content": [{**image, "cache_control": MARK}]}]
    second = [{"role": "user", "content": [image, _text("What is on it?", MARK)]}]
    rows = _rows(real_model, tmp_path, [_body(0, first), _body(10, second)], name="img.jsonl")["requests"]
    assert rows[1]["cache_read_tokens"] == rows[0]["cache_write_tokens"] > 1024
    five = [{"role": "user", "content": [_text(f"Part {k}.", MARK) for k in range(5)]}]
    rows = _rows(real_model, tmp_path, [_body(0, five)], name="five.jsonl")["requests"]
    four = [{"role": "user", "content": [_text(f"Part {k}.", MARK if k < 4 else None) for k in range(5)]}]
    same = _rows(real_model, tmp_path, [_body(0, four)], name="four.jsonl")["requests"]
    assert rows[0]["cache_write_tokens"] == same[0]["cache_write_tokens"]  # the fifth mark writes nothing


def test_an_entry_is_readable_once_its_writers_answer_began(real_model, tmp_path):
    """The proxy records when each answer began (first_byte_ms): a request arriving 0.2 s after
    one whose answer began 0.5 s in reads nothing; after one whose answer began 0.1 s in, all."""
    ask = [{"role": "user", "content": "Which glue for oak?"}]
    for began, reads in ((500, False), (100, True)):
        bodies = [{**_body(0, ask, MARK), "first_byte_ms": began}, _body(0.2, ask, MARK)]
        rows = _rows(real_model, tmp_path, bodies, name=f"{began}.jsonl")["requests"]
        assert (rows[1]["cache_read_tokens"] == rows[0]["cache_write_tokens"] > 1024) is reads


def test_an_automatic_cache_is_not_read_before_its_writers_answer_began(real_model, tmp_path):
    system = {"role": "system", "content": f"You are a store assistant. {SYSTEM}"}
    def ask(at, **extra):
        return {"model": "gpt-4o", "timestamp": _ms(at), **extra,
                "messages": [system, {"role": "user", "content": "Which glue for oak?"}]}
    for name in ("openai", "deepseek", "mistral"):
        rows = _rows(real_model, tmp_path, [ask(0), ask(0), ask(1)], rules=name, name=f"{name}.jsonl")
        assert [r["cache_read_tokens"] > 0 for r in rows["requests"]] == [False, False, True], name
    rows = _rows(real_model, tmp_path, [ask(0, first_byte_ms=500), ask(0.2), ask(0.6)], rules="openai",
                 name="began.jsonl")["requests"]
    assert [r["cache_read_tokens"] > 0 for r in rows] == [False, False, True]


def test_the_breakpoint_model_equals_the_documented_rule_by_brute_force():
    """Random block sequences, marks, lifetimes and arrivals (some at once): each request reads the
    longest prefix, ending at one of its block boundaries at most `lookback` boundaries before one
    of its marks, that an earlier request wrote at a mark, still alive and begun; it writes from
    there to its last mark; a read refreshes what it read."""
    import random

    from app.advise.prompts import Prompt
    from app.advise.rules import Prices, RuleSet
    from app.advise.simulate import simulate
    from app.advise.traffic import Request
    rng = random.Random(11)
    rules = RuleSet("b", "2026-01-01", "test", min_prefix_tokens=4, granularity_tokens=1, ttl_seconds=10.0,
                    breakpoints=True, tokenizer="model", prices=Prices(1.0, 0.1, 1.25, 2.0, 2.0),
                    long_ttl_seconds=40.0, lookback_blocks=3)
    pieces = [[rng.randrange(4) for _ in range(rng.randrange(1, 4))] for _ in range(5)]
    reads = writes = 0
    for _ in range(60):
        requests, prompts, times, seqs = [], [], [0.0], [[]]
        for k in range(20):  # each prompt extends some earlier one's blocks, cut somewhere
            base = rng.choice(seqs)
            blocks = base[:rng.randrange(len(base) // 2, len(base) + 1)]
            blocks += [rng.randrange(5) for _ in range(rng.randrange(1, 5))]
            seqs.append(blocks)
            tokens, ends = [], []
            for b in blocks:
                tokens += pieces[b]
                ends.append(len(tokens))
            marks = sorted(rng.sample(ends, rng.randrange(0, min(3, len(ends)) + 1)))
            marks = sorted({*marks, ends[-1]} if rng.random() < 0.7 else marks)  # mostly the last block too
            long = sorted([rng.random() < 0.3 for _ in marks], reverse=True)  # 1 h marks come first
            prompts.append(Prompt("", tokens, [], marks=marks, long=long, blocks=ends))
            if k:
                times.append(times[-1] + rng.choice([0.0, 2.0, 12.0, 45.0]))
            requests.append(Request(line=k + 1, arrival_s=times[-1]))
        got = simulate(rules, requests, prompts)
        entries: dict[tuple, list] = {}  # prefix -> [expires, ready, ttl]
        for k, (p, now) in enumerate(zip(prompts, times)):
            bounds = sorted(set(p.blocks) | set(p.marks))
            looked = {b for m in p.marks for b in bounds[max(0, bounds.index(m) - 3):bounds.index(m) + 1]}
            live = [b for b in looked if b >= 4 and tuple(p.tokens[:b]) in entries
                    and now <= entries[tuple(p.tokens[:b])][0] and entries[tuple(p.tokens[:b])][1] < now]
            read = max(live, default=0)
            if read:
                e = entries[tuple(p.tokens[:read])]
                e[0] = now + e[2]
            last, written, written_long = read, 0, 0
            for m, lg in zip(p.marks, p.long):
                if m < 4:
                    continue
                if m > last:
                    written += m - last
                    written_long += (m - last) if lg else 0
                    last = m
                ttl = 40.0 if lg else 10.0
                e = entries.get(tuple(p.tokens[:m]))
                if e is not None and now <= e[0]:
                    e[0], e[2], e[1] = max(e[0], now + ttl), max(e[2], ttl), min(e[1], now)
                elif m > read:
                    entries[tuple(p.tokens[:m])] = [now + ttl, now, ttl]
            assert (got[k].cached_tokens, got[k].written_tokens, got[k].written_long_tokens) == \
                (read, written, written_long), k
            reads, writes = reads + (read > 0), writes + (written > 0)
    assert reads > 50 and writes > 50  # the cases were met
