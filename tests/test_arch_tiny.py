"""qwen2, qwen3, llama with SentencePiece and gemma3 on tiny GGUFs, against llama.cpp.

llama.cpp's tokenizations and logits on these exact files are stored in
tests/data/tiny_arch_reference.json (made by `python -m tests.tiny_arch DIR` with
llama-cpp-python); when llama-cpp-python is installed the same comparison also runs live.
The weights are float32, so the only difference is llama.cpp's float16 KV cache.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine as dl
from engine import attention as ea
from tests.prefix_helpers import teardown
from tests.tiny_arch import ARCHS, KEPT_POSITIONS, REFERENCE_FILE, llama_cpp_outputs, write_arch_gguf

LOGIT_TOL = 4e-3  # of the largest |logit|: llama.cpp keeps K and V in float16


@pytest.fixture(scope="module")
def arch_reference() -> dict:
    with open(REFERENCE_FILE, encoding="utf-8") as fh:
        return json.load(fh)["archs"]


@pytest.fixture(scope="module")
def arch_paths(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("arch")
    return {a: write_arch_gguf(folder / f"{a}.gguf", a) for a in ARCHS}


@pytest.fixture(scope="module")
def arch_models(arch_paths) -> dict:
    return {a: dl.load_model(p) for a, p in arch_paths.items()}


def all_logits(m, tokens: list[int], page_rows: int = 4) -> np.ndarray:
    s = dl.create_session(m, dl.create_kv_pool(m, page_rows=page_rows))
    out = dl.eval_batch(m, [s], [tokens], all_positions=True)       # [N, vocab]
    dl.release_kv_pages(s)
    return out


def assert_close_to(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    diff = float(np.abs(ours - ref).max())
    assert diff <= LOGIT_TOL * float(np.abs(ref).max()), f"{what}: logits differ by {diff}"
    assert (ours.argmax(-1) == ref.argmax(-1)).all(), f"{what}: argmax differs"


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_matches_llama_cpp(arch_models, arch_reference, arch):
    m = arch_models[arch]
    for item in arch_reference[arch]["texts"]:
        assert dl.encode(m, item["text"]) == item["ids"], item["text"]
        if "<" not in item["text"]:  # specials decode to their text, as llama.cpp prints them
            assert dl.decode(m, item["ids"]) == item["text"]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_stored_llama_cpp(arch_models, arch_reference, arch):
    ref = arch_reference[arch]
    ours = all_logits(arch_models[arch], ref["tokens"])[-KEPT_POSITIONS:]
    assert_close_to(ours, np.asarray(ref["logits"], dtype=np.float32), arch)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed: the stored llama.cpp logits still checked")
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_live_llama_cpp(arch_models, arch_paths, arch):
    live = llama_cpp_outputs(arch_paths[arch], arch)
    m = arch_models[arch]
    assert [dl.encode(m, t["text"]) for t in live["texts"]] == [t["ids"] for t in live["texts"]]
    ours = all_logits(m, live["tokens"])[-KEPT_POSITIONS:]
    assert_close_to(ours, np.asarray(live["logits"], dtype=np.float32), arch)


def test_features_each_architecture_turns_on(arch_models):
    c = {a: m.config for a, m in arch_models.items()}
    assert c["qwen2"].qkv_bias and c["qwen2"].rope_neox and not c["qwen2"].qk_norm
    assert c["qwen3"].qk_norm and not c["qwen3"].qkv_bias and c["qwen3"].q_dim == 128 != c["qwen3"].d_model
    assert not c["llama-spm"].rope_neox and arch_models["llama-spm"].tokenizer_model == "llama"
    g = c["gemma3"]
    assert g.post_norms and g.ffn_act == "gelu_tanh" and g.embed_scale == pytest.approx(8.0)
    assert [g.layer_window(i) for i in range(6)] == [8, 8, 8, 8, 8, 0]
    assert [g.layer_rope(i)[0] for i in range(6)] == [10000.0] * 5 + [1e6]
    assert "SentencePiece" in arch_models["gemma3"].describe()
    assert arch_models["qwen2"].describe().endswith("byte-level BPE tokenizer, F32 x27")


def test_bos_leads_prompts_only_where_the_model_wants_it(arch_models):
    spm, gemma, qwen = arch_models["llama-spm"], arch_models["gemma3"], arch_models["qwen2"]
    assert dl.encode(spm, "the hill")[0] != 1                    # encode: never a BOS
    assert spm.tokenizer.encode_prompt("the hill") == [1] + dl.encode(spm, "the hill")
    assert gemma.tokenizer.encode_prompt("<bos>hi") == dl.encode(gemma, "<bos>hi")  # not twice
    assert qwen.tokenizer.encode_prompt("the hill") == dl.encode(qwen, "the hill")  # add_bos false


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_cache_hit_equals_miss(arch_models, arch):
    m = arch_models[arch]
    ids = [int(t) for t in np.random.default_rng(3).integers(10, m.config.vocab_size, 30)]
    pool = dl.create_kv_pool(m, page_rows=4)
    cache = dl.create_prefix_cache()
    s1 = dl.create_session(m, pool)
    miss = dl.eval(m, s1, ids)
    dl.prefix_insert(cache, pool, s1, ids)
    s2 = dl.create_session(m, pool)
    matched = dl.prefix_attach(cache, pool, s2, ids)
    assert matched == 28
    np.testing.assert_allclose(dl.eval(m, s2, ids[matched:]), miss, rtol=1e-5, atol=1e-5)
    teardown((s1, s2), cache, pool)


def test_sliding_layers_read_only_the_pages_in_their_window(arch_models):
    """Garbage in the pages before a sliding layer's window changes nothing; in a global layer it does."""
    m = arch_models["gemma3"]
    ids = [int(t) for t in np.random.default_rng(5).integers(10, m.config.vocab_size, 25)]
    pool = dl.create_kv_pool(m, page_rows=4)
    s = dl.create_session(m, pool)
    dl.eval(m, s, ids)
    # the next query sits at position 25 and sees 18..25: pages 0-3 (positions 0-15) are outside
    assert ea.window_first_page(25, 8, 4) == 4
    clean = dl.eval(m, s, [200])
    dl.release_kv_pages(s)
    s = dl.create_session(m, pool)
    dl.eval(m, s, ids)
    old = s.page_table[:4]
    sliding = [i for i in range(6) if m.config.is_sliding(i)]
    for layer in sliding:
        pool.k[layer, old] = np.nan
        pool.v[layer, old] = np.nan
    np.testing.assert_array_equal(dl.eval(m, s, [200]), clean)
    dl.release_kv_pages(s)
    s = dl.create_session(m, pool)
    dl.eval(m, s, ids)
    pool.k[5, s.page_table[:4]] += 1.0                            # the global layer reads them all
    assert not np.allclose(dl.eval(m, s, [200]), clean)
    dl.release_kv_pages(s)


def test_gemma_without_a_chat_template_uses_gemma_turns(arch_models):
    tk = arch_models["gemma3"].tokenizer
    assert "Gemma" in tk.template_warning and "continues text" in tk.template_warning
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"}]
    text = tk.render_chat(messages)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\n"
                    "hello<end_of_turn>\n<start_of_turn>user\nand?<end_of_turn>\n<start_of_turn>model\n")
    ids = tk.encode(text)
    assert ids[:2] == [2, 4] and ids.count(2) == 1          # one BOS, then <start_of_turn>
    assert tk.encode_prompt(text) == ids
    # other families keep the ChatML fallback and its warning
    assert "ChatML" in arch_models["llama-spm"].tokenizer.template_warning


def test_chat_prompts_start_with_one_bos_where_the_model_wants_it(arch_models):
    from engine.chat import Conversation, chat_prompt, start_turn, turn_messages
    first = {a: chat_prompt(m.tokenizer, turn_messages("Be brief.", "hi")) for a, m in arch_models.items()}
    assert first["gemma3"][0] == 2 and first["gemma3"].count(2) == 1   # template writes <bos>
    assert first["llama-spm"][0] == 1 and first["llama-spm"].count(1) == 1  # ChatML: BOS added
    assert first["qwen2"] == dl.encode(  # add_bos_token false: nothing added
        arch_models["qwen2"], arch_models["qwen2"].tokenizer.render_chat(turn_messages("Be brief.", "hi")))
    turn = start_turn(arch_models["gemma3"].tokenizer, Conversation("c"), turn_messages("Be brief.", "hi"))
    assert list(turn.prompt) == first["gemma3"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_characters="<\u2581"), max_size=40))
def test_sentencepiece_round_trip(arch_models, text):
    """Byte fallback covers every character; decode gives the text back (the SPM prefix space dropped).

    Not '▁' itself: SentencePiece's space marker decodes as a space, in llama.cpp too.
    """
    for arch in ("gemma3", "llama-spm"):
        m = arch_models[arch]
        ids = dl.encode(m, text)
        assert all(0 <= i < m.config.vocab_size for i in ids)
        assert dl.decode(m, ids) == text, (arch, ids)
        stream = m.tokenizer.stream()                           # what the app shows as it streams
        assert "".join(stream.step(i) for i in ids) == text, (arch, ids)


def test_page_map_says_which_layers_still_read_a_page(arch_models):
    from engine.loop import EngineLoop
    from engine.scheduler import SchedulerSettings
    from engine.snapshot import SnapshotMaker
    m = arch_models["gemma3"]
    loop = EngineLoop(m, SchedulerSettings(page_rows=4, chunk_tokens=64))
    sch = loop.scheduler
    ids = [int(t) for t in np.random.default_rng(9).integers(10, m.config.vocab_size, 30)]
    rid = loop.submit_now(prompt=ids, sampling=dl.SamplingParams(temperature=0.0), max_new_tokens=4)
    loop.step()                                                  # the whole prompt, one step
    snap = SnapshotMaker().take(sch)
    owned = sorted((p.first_position, p.read_by) for p in snap.pages.values() if rid in p.owners)
    assert owned[0] == (0, "1 full-attention layer only "
                           "(it lies before the 8-position window of the other 5)")
    assert owned[-1][1] == "all layers"
    while loop.has_work():
        loop.step()


def test_served_text_completions_start_with_the_models_bos(arch_models):
    from app.serve.protocol import ParsedRequest
    from app.serve.server import _chat_args
    for arch, bos in (("llama-spm", [1]), ("gemma3", [2]), ("qwen2", [])):
        m = arch_models[arch]
        kw = _chat_args(ParsedRequest(chat=False, prompt_text="the hill"), m, "", 8)
        assert kw["prompt"] == bos + dl.encode(m, "the hill"), arch
