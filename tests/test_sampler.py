"""The sampler: greedy, seeding, top-k / top-p / min-p as llama.cpp does, penalties, settings."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from engine import Sampler, SamplingParams
from engine.sampler import apply_repeat_penalty, filter_candidates


def logits_of(probs) -> np.ndarray:
    """Logits whose softmax is `probs` (float32, like the engine's)."""
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


@pytest.fixture
def rng_logits():
    return np.random.default_rng(7).standard_normal((20, 300)).astype(np.float32) * 3


def test_greedy_is_argmax(rng_logits):
    s = Sampler(SamplingParams(temperature=0.0))
    for row in rng_logits:
        assert s.sample(row) == int(np.argmax(row))


def test_same_seed_same_samples_and_other_seed_differs(rng_logits):
    p = dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    a = [Sampler(SamplingParams(seed=42, **p)).sample(r) for r in rng_logits]
    b = [Sampler(SamplingParams(seed=42, **p)).sample(r) for r in rng_logits]
    c = [Sampler(SamplingParams(seed=43, **p)).sample(r) for r in rng_logits]
    assert a == b
    assert a != c
    # one sampler draws a sequence: replayed exactly by a fresh one with the same seed
    s1, s2 = Sampler(SamplingParams(seed=5, **p)), Sampler(SamplingParams(seed=5, **p))
    row = rng_logits[0]
    assert [s1.sample(row) for _ in range(50)] == [s2.sample(row) for _ in range(50)]


def test_top_k_1_is_argmax(rng_logits):
    s = Sampler(SamplingParams(temperature=5.0, top_k=1, top_p=1.0, min_p=0.0, seed=1))
    for row in rng_logits:
        for _ in range(5):
            assert s.sample(row) == int(np.argmax(row))


def test_top_k_keeps_the_k_largest(rng_logits):
    p = SamplingParams(top_k=10, top_p=1.0, min_p=0.0)
    for row in rng_logits:
        ids, vals = filter_candidates(row, p)
        assert set(ids.tolist()) == set(np.argsort(-row)[:10].tolist())
        assert list(vals) == sorted(vals, reverse=True)


def test_top_p_keeps_the_smallest_set_reaching_p():
    row = logits_of([0.05, 0.5, 0.15, 0.3])
    ids_of = lambda p: set(filter_candidates(row, SamplingParams(top_k=0, top_p=p, min_p=0.0))[0].tolist())  # noqa: E731
    assert ids_of(0.4) == {1}              # 0.5 already reaches 0.4
    assert ids_of(0.79) == {1, 3}          # 0.5 + 0.3 = 0.8 >= 0.79
    assert ids_of(0.81) == {1, 3, 2}       # needs the 0.15 too
    assert ids_of(0.96) == {1, 3, 2, 0}
    assert ids_of(1.0) == {0, 1, 2, 3}


def test_top_p_applies_after_top_k():
    # llama.cpp renormalises over the top-k survivors before top-p
    row = logits_of([0.4, 0.3, 0.2, 0.1])
    ids, _ = filter_candidates(row, SamplingParams(top_k=2, top_p=0.5, min_p=0.0))
    assert ids.tolist() == [0]           # 0.4 / 0.7 = 0.57 >= 0.5
    ids, _ = filter_candidates(row, SamplingParams(top_k=2, top_p=0.6, min_p=0.0))
    assert ids.tolist() == [0, 1]


def test_min_p_keeps_tokens_at_least_min_p_times_the_best():
    row = logits_of([0.5, 0.26, 0.24, 0.004, 1e-12])
    ids_of = lambda m: set(filter_candidates(row, SamplingParams(top_k=0, top_p=1.0, min_p=m))[0].tolist())  # noqa: E731
    assert ids_of(0.5) == {0, 1}           # 0.26 >= 0.25, 0.24 < 0.25
    assert ids_of(0.45) == {0, 1, 2}
    assert ids_of(0.01) == {0, 1, 2}       # 0.004 < 0.005
    assert ids_of(0.0) == {0, 1, 2, 3, 4}


def test_samples_stay_in_the_candidate_set_with_the_right_frequencies():
    row = logits_of([0.4, 0.3, 0.2, 0.1])
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=0.7, min_p=0.0, seed=3))
    counts = Counter(s.sample(row) for _ in range(4000))
    assert set(counts) == {0, 1}
    # renormalised: 0.4/0.7 and 0.3/0.7
    assert abs(counts[0] / 4000 - 4 / 7) < 0.03
    hot = Sampler(SamplingParams(temperature=100.0, top_k=3, top_p=1.0, min_p=0.0, seed=3))
    counts = Counter(hot.sample(row) for _ in range(3000))
    assert set(counts) == {0, 1, 2} and min(counts.values()) > 800   # nearly uniform over 3


def test_repeat_penalty_lowers_repeated_tokens():
    row = np.array([2.0, 1.9, -0.5, -0.6, 0.0], dtype=np.float32)
    original = row.copy()
    out = apply_repeat_penalty(row, [0, 2, 0], 1.25)
    assert out[0] == pytest.approx(2.0 / 1.25) and out[2] == pytest.approx(-0.5 * 1.25)
    assert out[1] == row[1] and out[3] == row[3] and out[4] == row[4]
    assert np.array_equal(row, original), "the input was modified"
    greedy = Sampler(SamplingParams(temperature=0.0, repeat_penalty=1.1, repeat_last_n=4))
    assert greedy.sample(row) == 0
    assert greedy.sample(row, history=[0]) == 1
    # only the last repeat_last_n tokens count
    assert greedy.sample(row, history=[0, 4, 4, 4, 4]) == 0
    assert Sampler(SamplingParams(repeat_penalty=1.1, repeat_last_n=0)).sample(row, [0]) == 0


@pytest.mark.parametrize("setting, value", [
    ("temperature", -0.1), ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5), ("min_p", -0.1),
    ("min_p", 1.0), ("repeat_penalty", 0.0), ("repeat_last_n", -1),
])
def test_bad_settings_raise_naming_the_setting(setting, value):
    with pytest.raises(ValueError, match=setting):
        Sampler(SamplingParams(**{setting: value}))
    with pytest.raises(ValueError, match=setting):
        SamplingParams(**{setting: value}).validate()


@pytest.mark.parametrize("bad", [dict(repeat_penalty=1e-40), dict(repeat_penalty=1e40),
                                 dict(temperature=float("nan")), dict(top_p=float("inf"))])
def test_settings_that_would_make_probabilities_non_finite_are_refused(bad):
    with pytest.raises(ValueError, match="bad sampling setting"):
        SamplingParams(**bad).validate()


def test_sampling_never_draws_from_nan_probabilities():
    """Logits that overflowed (inf) or broke (NaN) still give a finite distribution: a token, no error."""
    logits = np.array([np.inf, 3.0, np.nan, np.inf, -np.inf, 1.0], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0))
    drawn = {s.sample(logits) for _ in range(50)}
    assert drawn <= {0, 1, 3, 5} and drawn & {0, 3}
    # the strongest legal penalty on a large logit stays finite as well
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1e-3, seed=0)
    assert Sampler(p).sample(np.array([30.0, 29.0, -5.0], dtype=np.float32), history=[0, 1]) in (0, 1, 2)
