"""Replay's readers on malformed traces: every bad field is an error naming the user's file and line."""

from __future__ import annotations

import json

import pytest

from app.cli import main
from app.replay.cli import finite_or_null
from app.replay.trace import TraceError, TraceHeader, open_trace

HELLO = [{"role": "user", "content": "Do you sell hammers?"}]


def lines(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("raw, words", [
    ('{"messages": %s, "max_tokens": 1e400}', ["'max_tokens' must be an integer", "inf"]),
    ('{"messages": %s, "max_tokens": [1]}', ["'max_tokens' must be an integer", "[1]"]),
    ('{"messages": %s, "max_tokens": -5}', ["'max_tokens' is negative: -5"]),
    ('{"messages": %s, "max_completion_tokens": "lots"}', ["'max_completion_tokens' must be an integer"]),
    ('{"messages": %s, "timestamp": 1e400}', ["'timestamp' must be a number >= 0 and finite"]),
    ('{"messages": %s, "extra": ' + "[" * 5000 + "]" * 5000 + "}", ["nested too deeply"]),
])
def test_a_bad_openai_log_line_names_the_users_file_and_line(tiny_gguf_path, tmp_path, raw, words, capsys):
    log = lines(tmp_path / "requests.jsonl", [{"messages": HELLO}, raw % json.dumps(HELLO)])
    with pytest.raises(SystemExit) as e:
        main(["replay", log, "--model", tiny_gguf_path, "--page-rows", "4", "--quiet", "--strict"])
    message = str(e.value)
    assert f"{log}, line 2:" in message and "prefixlab-replay-" not in message, message
    assert all(w in message for w in words), message
    # without --strict the line is skipped, and the same words say why on one line
    assert main(["replay", log, "--model", tiny_gguf_path, "--page-rows", "4", "--quiet"]) == 0
    out = capsys.readouterr()
    said = [line for line in out.err.splitlines() if "skipped 1 bad line" in line]
    assert len(said) == 1 and "line 2:" in said[0] and all(w in said[0] for w in words), out.err
    assert " 1  " in out.out.splitlines()[1]  # the good request replayed


GOOD = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}


@pytest.mark.parametrize("row, words", [
    ({**GOOD, "timestamp": 1e400}, ["'timestamp'", "finite"]),
    ({**GOOD, "input_length": [1]}, ["'input_length'"]),
    ({**GOOD, "output_length": -5}, ["'output_length' is negative"]),
])
def test_a_bad_mooncake_line_names_the_file_and_line(tmp_path, row, words):
    good = GOOD
    path = lines(tmp_path / "mooncake.jsonl", [good, row])
    with pytest.raises(TraceError) as e:
        list(open_trace(path))
    assert f"{path}, line 2:" in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_a_prefixlab_trace_with_an_infinite_arrival_is_refused(tmp_path):
    path = lines(tmp_path / "t.jsonl", [TraceHeader(page_rows=4).to_json(),
                                        '{"arrival_s": 1e999, "prompt": [1]}'])
    with pytest.raises(TraceError, match=r"line 2: 'arrival_s' must be a number >= 0 and finite"):
        list(open_trace(path))


def test_replay_json_is_strict(tmp_path):
    trace = lines(tmp_path / "t.jsonl", [TraceHeader(page_rows=4).to_json(),
                                         {"arrival_s": 0, "prompt": [1, 2, 3, 4, 5]},
                                         {"arrival_s": 1, "prompt": [1, 2, 3, 4, 6]}])
    out = tmp_path / "rows.json"
    assert main(["replay", trace, "--json", str(out), "--quiet"]) == 0

    def refuse(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")
    assert json.loads(out.read_text(), parse_constant=refuse)["rows"]
    inf, nan = float("inf"), float("nan")
    assert finite_or_null({"a": [inf, 1.5, nan], "b": "x"}) == {"a": [None, 1.5, None], "b": "x"}
