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


def test_kv_budget_sizes_and_host_names():
    from app.serve.budget import parse_budget
    from app.serve.guard import host_name, local_hosts

    assert parse_budget("10%", ram=1000) == 100 and parse_budget("0") == 0
    assert parse_budget("2GiB") == 2 * 2**30 and parse_budget("500MB") == 500_000_000
    with pytest.raises(ValueError, match="--kv-budget"):
        parse_budget("lots")
    assert [host_name(h) for h in ("[::1]:8000", "Example.COM:80", "::1", "localhost")] == \
        ["::1", "example.com", "::1", "localhost"]
    assert {"localhost", "127.0.0.1", "::1", "10.0.0.5", "box.lan"} <= local_hosts("10.0.0.5", ["box.lan"])
    assert local_hosts("127.0.0.1", ["*"]) is None


def test_text_is_checked_where_it_enters():
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": [{"role": "system", "content": "ok"},
                                 {"role": "user", "content": "a\ud800"}]})
    assert e.value.param == "messages[1].content"
    req = parse_chat({"messages": [{"role": "user", "content": "hi"}], "user": "u" * 10_000})
    assert len(req.user) <= 64
    for field, value in (("cache_salt", "s" * 300), ("stop", ["x" * 300])):
        with pytest.raises(ApiError) as e:
            parse_chat({"messages": [{"role": "user", "content": "hi"}], field: value})
        assert e.value.param == field


def test_friendliness_keeps_a_bounded_number_of_clients_per_tenant():
    from app.serve.friendliness import MAX_CLIENTS, OTHERS, Friendliness
    from engine.loop import Job
    from engine.metrics import RequestRecord
    from engine.scheduler import FinishEvent

    f = Friendliness()
    for i in range(MAX_CLIENTS + 50):
        record = RequestRecord(id=i, preview="", conversation_id=None, namespace="", n_prompt=4)
        job = Job({}, client=f"http 127.0.0.1 user=u{i}", tenant="key-a")
        f.observe(job, FinishEvent(i, "stop", record), None)
    clients = f.to_dict("key-a")["clients"]
    assert len(clients) == MAX_CLIENTS + 1 and clients[0] == {**clients[0], "client": OTHERS, "requests": 50}
    assert f.to_dict("key-b")["clients"] == []


def test_the_kv_budget_bounds_the_pool_and_fits_one_full_request(tiny_model):
    from app.serve.budget import page_bytes, with_budget
    from engine.scheduler import SchedulerSettings

    one = page_bytes(tiny_model, 16)
    s = with_budget(SchedulerSettings(page_rows=16), tiny_model, 1000 * one)
    assert s.pool_pages == s.cache_pages == 1000
    tiny = with_budget(SchedulerSettings(page_rows=16), tiny_model, one)  # less than one request needs
    assert tiny.pool_pages * 16 > tiny_model.config.context_length
    for own in (SchedulerSettings(pool_pages=77), SchedulerSettings(cache_pages=5)):
        assert with_budget(own, tiny_model, 1000 * one) == own  # the user's own bound wins
    assert with_budget(SchedulerSettings(), tiny_model, 0) == SchedulerSettings()
