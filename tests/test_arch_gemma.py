"""Gemma 3 270M Q4_K_M against llama.cpp (tests/data/gemma3-270m-q4_k_m.json), and its cache.

Gemma 3 brings a SentencePiece vocabulary of 262,144 tokens, BOS-led prompts, QK-norm,
post-norms, GELU-tanh, scaled embeddings and sliding-window layers (512 positions, 15 of
18 layers): every one of them shows in these numbers when it is wrong.
"""

from __future__ import annotations

import numpy as np
import pytest

import engine as dl
from tests import fidelity
from tests.prefix_helpers import teardown

pytestmark = pytest.mark.gemma


@pytest.fixture(scope="module")
def gemma_reference() -> dict:
    return fidelity.load_reference("gemma3-270m-q4_k_m.json")


@pytest.fixture(scope="module")
def teacher_forced(gemma_model, gemma_reference):
    return fidelity.teacher_forced(gemma_model, gemma_reference)


def test_describes_architecture_tokenizer_and_quant_mix(gemma_model):
    m = gemma_model
    assert (m.arch, m.tokenizer_model, m.config.head_dim, m.config.sliding_window) == (
        "gemma3", "llama", 256, 512)
    assert m.quant_mix == "Q4_K x27, Q5_0 x81, Q6_K x9, Q8_0 x10, F32 x109"
    text = m.describe()
    assert "gemma3" in text and "SentencePiece" in text and "sliding window 512 on 15/18" in text
    assert text.endswith("every decoded token reads a 671 MB output head")
    assert m.tokenizer.prompt_prefix_ids == [2] and m.tokenizer.add_bos


def test_reference_texts_tokenize_exactly(gemma_model, gemma_reference):
    wrong = fidelity.tokenization_mismatches(gemma_model, gemma_reference)
    assert not wrong, f"{len(wrong)} texts tokenize differently from llama.cpp: {wrong[:3]}"
    assert len(gemma_reference["texts"]) == 34
    assert all(r["prompt_ids"][0] == 2 for r in gemma_reference["runs"])  # BOS-led prompts


def test_teacher_forced_argmax_matches_llama_cpp(gemma_reference, teacher_forced):
    got = fidelity.argmax_agreement(gemma_reference, teacher_forced)
    assert got["n_clear"] >= 150
    assert got["clear_rate"] >= 0.99, got
    assert got["all_rate"] >= 0.9, got


def test_greedy_generation_follows_llama_cpp(gemma_model, gemma_reference):
    exact, report = fidelity.greedy_agreement(gemma_model, gemma_reference)
    # Measured: 3 of 6 runs reproduce all 16 tokens; the other 3 part where llama.cpp's own
    # top-two gap is 0.14, 0.003 and 0.05. Those ties are below llama.cpp's own noise: its logits
    # move by up to 0.6 with the batching alone (a 1e-7 change of float summation order flips
    # single 8-bit activation roundings, which 18 layers amplify), and llama.cpp 0.3.36 itself, on
    # this file and an AVX-512 CPU, reproduces 3 of these 6 runs (4 when each run reuses the
    # previous one's KV). An emulation of ggml's numerics (Q8_0/Q8_K activations with its
    # rounding, f16 K/V/Q and probabilities, its f16 GELU table and RoPE angles), equal to
    # llama.cpp's tensors to 1e-7 up to the first flipped rounding, also reproduces 3 of 6.
    assert exact >= 3, report
    assert all(margin is None or margin < 0.15 for _r, _what, margin in report), report


def test_last_prompt_top8_logits_are_close(gemma_reference, teacher_forced):
    fidelity.check_top8(gemma_reference, teacher_forced, shape_tol=0.6, offset_tol=1.5)


def _story(m, n_tokens: int) -> list[int]:
    words = ("the lighthouse keeper counted ships at dawn while gulls argued over the harbour "
             "and the tide carried old letters back to the town ").split()
    text = " ".join(words[i % len(words)] + ("." if i % 11 == 10 else "") for i in range(n_tokens))
    ids = m.tokenizer.encode_prompt(text)
    assert len(ids) > n_tokens
    return ids[:n_tokens]


@pytest.mark.parametrize("n_tokens", [100, 700])
def test_cache_hit_equals_miss_also_past_the_sliding_window(gemma_model, n_tokens):
    """Logits with the first pages attached from the cache equal those computed from scratch."""
    m = gemma_model
    ids = _story(m, n_tokens)
    pool = dl.create_kv_pool(m, page_rows=16)
    cache = dl.create_prefix_cache()
    s1 = dl.create_session(m, pool)
    miss = dl.eval(m, s1, ids)
    assert dl.prefix_insert(cache, pool, s1, ids, "story") == n_tokens // 16
    s2 = dl.create_session(m, pool)
    matched = dl.prefix_attach(cache, pool, s2, ids)
    assert matched == (n_tokens - 1) // 16 * 16 and matched > (512 if n_tokens > 512 else 0)
    hit = dl.eval(m, s2, ids[matched:])
    scale = float(np.abs(miss).max())
    np.testing.assert_allclose(hit, miss, rtol=0, atol=2e-4 * scale)
    assert int(hit.argmax()) == int(miss.argmax())
    # and the next decode step agrees too (its sliding layers read only the window's pages)
    nxt = int(miss.argmax())
    np.testing.assert_allclose(dl.eval(m, s2, [nxt]), dl.eval(m, s1, [nxt]), rtol=0, atol=2e-4 * scale)
    teardown((s1, s2), cache, pool)


def test_text_round_trips_and_streams(gemma_model):
    text = "naïve café — 中文 and émoji 🎉🙂🙃 Ελληνικά\n\tdef f(x):  return x\x01"
    ids = dl.encode(gemma_model, text)
    assert dl.decode(gemma_model, ids) == text
    stream = gemma_model.tokenizer.stream()
    pieces = [stream.step(i) for i in ids]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
