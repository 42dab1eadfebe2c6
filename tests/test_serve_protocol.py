"""The server's pure parts: stop strings cut across pieces, request checks name the field."""

from __future__ import annotations

import pytest

from app.serve.protocol import ApiError, StopFilter, parse_chat, parse_completion


@pytest.mark.parametrize("pieces,stops,sent", [
    (["Hel", "lo W", "orld"], ["o W"], "Hell"),                    # a stop split over two pieces
    (["The answer", " is 4", "2."], ["42"], "The answer is "),
    (["a", "b", "c"], ["bd"], "abc"),                             # a held prefix that never completes
    (["x<", "|im_", "end|>", "more"], ["<|im_end|>", "zz"], "x"),
    (["no stops here"], [], "no stops here"),
])
def test_stop_filter_never_sends_text_of_a_stop_string(pieces, stops, sent):
    f = StopFilter(stops)
    out = [f.feed(p) for p in pieces]
    out.append(f.flush())
    assert "".join(out) == sent


def test_checks_name_the_field_that_is_wrong():
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "top_p": 0})
    assert e.value.param == "top_p" and "(0, 1]" in e.value.message
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 5})
    assert e.value.param == "stop"
    with pytest.raises(ApiError, match="only text parts"):
        parse_chat({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    with pytest.raises(ApiError, match="several prompts"):
        parse_completion({"prompt": ["a", "b"]})


def test_openai_defaults_and_llama_cpp_extensions():
    req = parse_chat({"messages": [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                                   {"role": "user", "content": "hi"}],
                      "max_completion_tokens": 7, "max_tokens": 99, "top_k": 40, "seed": 3})
    assert req.messages[0] == {"role": "system", "content": "Be brief."}
    assert req.max_tokens == 7  # max_completion_tokens wins, as in OpenAI's API
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (1.0, 1.0, 40, 0.0, 3)
    assert parse_completion({"prompt": [[1, 2, 3]]}).prompt_ids == [1, 2, 3]
