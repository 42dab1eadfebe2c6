"""Tokenizer and chat template: rendering, the sandbox, stream decoding, round trips."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine import TemplateError
from engine.chat import FALLBACK_TEMPLATE, checked_template, render_template
from tests.tiny_gguf import SPECIALS, byte_alphabet, write_tiny_gguf

ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.system('echo pwned') }}",
    "{{ joiner.__init__.__globals__['__builtins__'] }}",
    "{{ self.__init__.__globals__ }}",
    "{% set x = messages.append({'role': 'x'}) %}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
]
BOMBS = [
    "{{ 'a' * 10**10 }}",
    "{{ 'a'|center(10**10) }}",
    "{{ '%999999999d' % 1 }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{% for i in range(100000) %}{{ 'abcdefghijklmnopqrstuvwxyz' }}{% endfor %}",
]
MESSAGES = [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Do you sell drills?"}]


def test_real_template_renders_like_the_reference_prompts(real_model, reference):
    tk = real_model.tokenizer
    text = tk.render_chat(MESSAGES, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert text == reference["runs"][0]["prompt"]
    assert engine.encode(real_model, text) == reference["runs"][0]["prompt_ids"]
    # without a system message SmolLM2's template adds its own, as llama.cpp's prompt has
    user_only = tk.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert user_only == reference["runs"][2]["prompt"]
    no_prompt = tk.render_chat(MESSAGES, add_generation_prompt=False)
    assert no_prompt.endswith("<|im_end|>\n") and "<|im_start|>assistant" not in no_prompt
    assert not tk.template_warning


@pytest.mark.parametrize("template", ESCAPES)
def test_sandbox_escapes_are_stopped(template):
    with pytest.raises(TemplateError, match="sandbox|unsafe"):
        render_template(template, MESSAGES)
    used, warning = checked_template(template)
    assert used == FALLBACK_TEMPLATE
    assert "ChatML" in warning and ("sandbox" in warning or "unsafe" in warning)


@pytest.mark.parametrize("template", BOMBS)
def test_memory_bombs_are_stopped(template):
    with pytest.raises(TemplateError):
        render_template(template, MESSAGES)
    assert checked_template(template)[0] == FALLBACK_TEMPLATE


def test_ordinary_template_arithmetic_still_works():
    out = render_template("{{ '%02d' % 7 }} {{ 'ab' * 3 }} {{ '{:>4}'.format('x') }} "
                          "{{ messages|length * 2 }} {{ 2 ** 10 }} {{ 'a' + 'b' }}", MESSAGES)
    assert out == "07 ababab    x 4 1024 ab"


def test_template_errors_fall_back_to_chatml():
    with pytest.raises(TemplateError, match="chat template raised: no tools"):
        render_template("{{ raise_exception('no tools') }}", MESSAGES)
    with pytest.raises(TemplateError, match="TemplateSyntaxError"):
        render_template("{% for m in messages %}", MESSAGES)
    assert checked_template("")[0] == FALLBACK_TEMPLATE
    assert "no chat template" in checked_template(None)[1]
    good = "{% for m in messages %}[{{ m.role }}]{% endfor %}"
    assert checked_template(good) == (good, "")


def test_model_with_hostile_template_uses_plain_chatml(tmp_path):
    path = write_tiny_gguf(tmp_path / "evil.gguf", chat_template=ESCAPES[1])
    m = engine.load_model(path)
    tk = m.tokenizer
    assert tk.chat_template == FALLBACK_TEMPLATE
    assert "sandbox" in tk.template_warning and "ChatML" in tk.template_warning
    text = tk.render_chat(MESSAGES)
    assert text == ("<|im_start|>system\nYou are a terse assistant.<|im_end|>\n"
                    "<|im_start|>user\nDo you sell drills?<|im_end|>\n<|im_start|>assistant\n")


MULTIBYTE = "naïve café — 中文 and émoji 🎉🙂🙃 Ελληνικά"


@pytest.mark.parametrize("which", ["tiny", "real"])
def test_stream_decoding_yields_the_full_text(request, which):
    m = request.getfixturevalue("tiny_model" if which == "tiny" else "real_model")
    ids = engine.encode(m, MULTIBYTE)
    stream = m.tokenizer.stream()
    pieces = [stream.step(i) for i in ids]
    assert "".join(pieces) == MULTIBYTE
    assert all("\ufffd" not in p for p in pieces), "a split character leaked as U+FFFD"
    if which == "tiny":  # byte tokens only: every multi-byte character spans several ids
        assert len(ids) > len(MULTIBYTE) and pieces.count("") > 5


def test_specials_are_parsed_and_stream_skips_them(tiny_model):
    ids = engine.encode(tiny_model, "<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == SPECIALS.index("<|im_start|>") and ids[-1] == SPECIALS.index("<|im_end|>")
    assert engine.decode(tiny_model, ids) == "<|im_start|>user\nhi<|im_end|>"
    stream = tiny_model.tokenizer.stream()
    assert "".join(stream.step(i) for i in ids) == "user\nhi"


def test_digits_split_one_by_one(real_model):
    ids = engine.encode(real_model, "12345")
    assert len(ids) == 5 and engine.decode(real_model, ids) == "12345"


def _no_specials(text: str) -> bool:
    return not any(s in text for s in SPECIALS)


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=80).filter(_no_specials))
def test_fuzz_tiny_round_trip(tiny_model, text):
    ids = engine.encode(tiny_model, text)
    assert all(0 <= i < tiny_model.config.vocab_size for i in ids)
    assert engine.decode(tiny_model, ids) == text


@pytest.fixture(scope="module")
def real_missing_bytes(real_model) -> set[int]:
    """Bytes SmolLM2's vocabulary has no token for (rare controls, unused UTF-8 lead bytes)."""
    vocab = real_model.tokenizer.tokenizer.get_vocab()
    return {b for b, ch in enumerate(byte_alphabet()) if ch not in vocab}


def test_real_vocabulary_drops_only_bytes_it_lacks(real_model, real_missing_bytes):
    # like llama.cpp, a byte with no token is dropped: only controls and bytes that
    # cannot start a character below U+40000 may be missing
    assert real_missing_bytes, "expected SmolLM2 to lack a few byte tokens"
    assert all(b < 0x20 or b in (0xC0, 0xC1) or b >= 0xF1 for b in real_missing_bytes)
    out = engine.decode(real_model, engine.encode(real_model, "a\U00040000b"))
    assert out.startswith("a") and out.endswith("b") and "\U00040000" not in out


@pytest.mark.model
@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=60).filter(_no_specials))
def test_fuzz_real_round_trip(real_model, real_missing_bytes, text):
    ids = engine.encode(real_model, text)
    if real_missing_bytes & set(text.encode("utf-8")):
        return  # see test_real_vocabulary_drops_only_bytes_it_lacks
    assert all(0 <= i < real_model.config.vocab_size for i in ids)
    assert engine.decode(real_model, ids) == text


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=40), special=st.sampled_from(SPECIALS))
def test_fuzz_text_with_specials_never_crashes(tiny_model, text, special):
    mixed = text[: len(text) // 2] + special + text[len(text) // 2:]
    ids = engine.encode(tiny_model, mixed)
    assert SPECIALS.index(special) in ids
    assert engine.decode(tiny_model, ids) == mixed
