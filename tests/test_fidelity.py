"""The engine against llama.cpp on the bundled model (tests/data/smollm2-135m-instruct-q4_1.json).

The comparisons live in tests/fidelity.py, shared with the Gemma 3 reference test.
"""

from __future__ import annotations

import numpy as np
import pytest

import engine as dl
from tests import fidelity

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def teacher_forced(real_model, reference):
    return fidelity.teacher_forced(real_model, reference)


def test_reference_texts_tokenize_exactly(real_model, reference):
    wrong = fidelity.tokenization_mismatches(real_model, reference)
    assert not wrong, f"{len(wrong)} texts tokenize differently from llama.cpp: {wrong[:3]}"


def test_teacher_forced_argmax_matches_llama_cpp(reference, teacher_forced):
    got = fidelity.argmax_agreement(reference, teacher_forced)
    assert got["n_clear"] > 200
    assert got["clear_rate"] >= 0.99, got
    assert got["all_rate"] >= 0.95, got


def test_float16_pages_still_match_llama_cpp_and_halve_the_bytes(real_model, reference):
    f16 = fidelity.teacher_forced(real_model, reference, kv_dtype="float16")
    got = fidelity.argmax_agreement(reference, f16)
    assert got["n_clear"] > 200
    assert got["clear_rate"] >= 0.99, got
    full, half = (dl.create_kv_pool(real_model, kv_dtype=d) for d in ("float32", "float16"))
    assert half.bytes_per_page * 2 == full.bytes_per_page
    assert half.k.dtype == np.float16 and half.capacity == full.capacity


def test_greedy_generation_follows_llama_cpp(real_model, reference):
    exact, report = fidelity.greedy_agreement(real_model, reference)
    assert exact >= 4, report


def test_last_prompt_top8_logits_are_close(reference, teacher_forced):
    fidelity.check_top8(reference, teacher_forced, shape_tol=0.4, offset_tol=1.5)
