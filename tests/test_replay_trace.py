"""Trace files: formats detected from the first line, streamed reads, bad lines named."""

from __future__ import annotations

import json
import os

import pytest

from app.replay.trace import (
    TraceError,
    TraceHeader,
    TraceRequest,
    open_trace,
    write_trace,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOONCAKE = os.path.join(ROOT, "resources", "traces", "mooncake", "conversation_trace.jsonl")


def write_lines(path, lines) -> str:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return str(path)


def mooncake_row(n=1000, ids=(0, 1), t=0, out=10) -> dict:
    return {"timestamp": t, "input_length": n, "output_length": out, "hash_ids": list(ids)}


def test_shipped_mooncake_trace_is_detected_and_read_whole():
    src = open_trace(MOONCAKE)
    assert (src.format, src.block_size, src.hashed) == ("mooncake", 512, True)
    n = total = 0
    for r in src:
        n += 1
        total += r.input_length
        assert len(r.hash_ids) == -(-r.input_length // 512)
    assert n == 12031
    first = next(iter(src))  # a source can be read again: each pass re-opens the file
    assert first.hash_ids[:3] == [0, 1, 2] and first.arrival_s == 0.0 and first.output_length == 500


@pytest.mark.parametrize("line, words", [
    ("{not json", ["line 2", "not valid JSON"]),
    ("[1, 2]", ["line 2", "expected a JSON object"]),
    ({"timestamp": 5, "output_length": 1, "hash_ids": [0]}, ["line 2", "missing field 'input_length'"]),
    ({"timestamp": 5, "input_length": 100, "output_length": 1}, ["line 2", "missing field 'hash_ids'"]),
    (mooncake_row(n=-5, ids=()), ["line 2", "'input_length' is negative: -5"]),
    (mooncake_row(out=-1), ["line 2", "'output_length' is negative: -1"]),
    (mooncake_row(n=1100, ids=(0, 1)), ["line 2", "2 hash_ids do not fit input_length 1100",
                                        "3 blocks of 512"]),
    (mooncake_row(ids=(0, "x")), ["line 2", "'hash_ids' must be a list of integers"]),
    (mooncake_row(t=-3), ["line 2", "'timestamp' must be a number >= 0"]),
])
def test_a_bad_line_is_named(tmp_path, line, words):
    path = write_lines(tmp_path / "t.jsonl", [mooncake_row(), line, mooncake_row()])
    src = open_trace(path)
    with pytest.raises(TraceError) as err:
        list(src)
    for w in words:
        assert w in str(err.value)
    assert path in str(err.value)


def test_reading_streams_line_by_line(tmp_path):
    """The first request comes out before the bad third line is read: nothing is loaded whole."""
    path = write_lines(tmp_path / "t.jsonl", [mooncake_row(ids=(7, 8)), mooncake_row(), "{broken"])
    it = iter(open_trace(path))
    assert next(it).hash_ids == [7, 8]
    assert next(it).hash_ids == [0, 1]
    with pytest.raises(TraceError, match="line 3"):
        next(it)


def test_empty_file_and_empty_trace(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(TraceError, match="empty"):
        open_trace(str(empty))
    header_only = write_lines(tmp_path / "h.jsonl", [TraceHeader(page_rows=16).to_json()])
    with pytest.raises(TraceError, match="no requests"):
        list(open_trace(header_only))


def test_binary_file_is_named(tmp_path):
    import gzip
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress(json.dumps(mooncake_row()).encode() * 50))
    with pytest.raises(TraceError, match="t.jsonl.gz: not UTF-8 text"):
        open_trace(str(path))


def test_unknown_first_line_and_missing_file(tmp_path):
    path = write_lines(tmp_path / "x.jsonl", [{"prompt": "hello"}])
    with pytest.raises(TraceError, match="line 1: not a trace line"):
        open_trace(path)
    with pytest.raises(TraceError, match="cannot open trace"):
        open_trace(str(tmp_path / "nope.jsonl"))


def test_block_size_option_checks_hash_ids(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [mooncake_row(n=100, ids=(0, 1, 2, 3))])
    assert [r.hash_ids for r in open_trace(path, block_size=32)] == [[0, 1, 2, 3]]
    with pytest.raises(TraceError, match="4 hash_ids do not fit input_length 100"):
        list(open_trace(path))  # 512 by default: one block expected


def test_prefixlab_trace_round_trips(tmp_path):
    reqs = [TraceRequest(arrival_s=0.5, input_length=3, output_length=2, namespace="ns", client="cli",
                         prompt=[1, 2, 3], donated=[1, 2, 3, 9], admitted_s=0.6, finish_s=1.5),
            TraceRequest(arrival_s=0.7, input_length=2, prompt=[4, 5], finish_s=0.8)]
    path = str(tmp_path / "s.jsonl")
    assert write_trace(path, TraceHeader(page_rows=4, model="m", settings={"page_rows": 4}), reqs) == 2
    src = open_trace(path)
    assert (src.format, src.header.page_rows, src.hashed, src.header.model) == ("prefixlab", 4, False, "m")
    assert list(src) == reqs


def test_prefixlab_bad_prompt_is_named(tmp_path):
    path = write_lines(tmp_path / "s.jsonl", [TraceHeader(page_rows=4).to_json(),
                                             {"arrival_s": 0, "prompt": [1, -2]}])
    with pytest.raises(TraceError, match="line 2: 'prompt' must be a non-empty list of token ids"):
        list(open_trace(path))


def test_openai_log_needs_a_tokenizer_and_names_bad_messages(tmp_path):
    path = write_lines(tmp_path / "o.jsonl", [{"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                                             {"model": "m", "messages": "hello"}])
    with pytest.raises(TraceError, match="needs a model"):
        open_trace(path)
    src = open_trace(path, tokenize=lambda msgs: [len(m["content"]) for m in msgs])
    it = iter(src)
    assert next(it).prompt == [2]
    with pytest.raises(TraceError, match="line 2: 'messages' must be a non-empty list"):
        next(it)


def test_a_failed_write_leaves_nothing(tmp_path):
    def bad_requests():
        yield TraceRequest(arrival_s=0, input_length=1, prompt=[1])
        raise TraceError("line 7: broken source")
    path = tmp_path / "out.jsonl"
    with pytest.raises(TraceError, match="broken source"):
        write_trace(str(path), TraceHeader(page_rows=16), bad_requests())
    assert os.listdir(tmp_path) == []
