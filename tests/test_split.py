"""engine/split.py: a big matmul's column blocks shared among threads give the very numbers
one thread gives, from any thread, and a helper's error reaches the caller."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from engine import split
from engine.layout import blocks_matmul, to_column_blocks


@pytest.fixture
def shared(monkeypatch):
    """Every matrix is big enough to share, among the parts a test sets."""
    monkeypatch.setattr(split, "SPLIT_BYTES", 0)
    yield split.set_parts
    split.set_parts(1)


def test_shared_blocks_equal_one_thread_bit_for_bit(shared):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 64 * 13), dtype=np.float32)
    blocks = to_column_blocks(w)                                       # [13, 96, 64]
    for rows in (1, 2, 8, 33):
        x = rng.standard_normal((rows, 96), dtype=np.float32)
        shared(1)
        alone = blocks_matmul(x, blocks)
        for parts in (2, 3, 5, 40):
            shared(parts)
            np.testing.assert_array_equal(blocks_matmul(x, blocks), alone)
        np.testing.assert_allclose(alone, x @ w, rtol=1e-4, atol=1e-4)
    assert any(t.name == "prefixlab-blocks" for t in threading.enumerate())  # it did share


def test_many_callers_at_once_each_get_their_own_answer(shared):
    """Two forward passes on two threads (the app's tour beside its worker): one shares, the
    other runs whole; neither reads the other's output."""
    shared(2)
    rng = np.random.default_rng(1)
    blocks = rng.standard_normal((24, 64, 64), dtype=np.float32)
    xs = [rng.standard_normal((4, 64), dtype=np.float32) for _ in range(4)]
    want = [np.matmul(x, blocks) for x in xs]
    bad = []

    def run(i):
        for _ in range(200):
            if not np.array_equal(split.matmul(xs[i], blocks), want[i]):
                bad.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


def test_an_error_in_a_helper_reaches_the_caller_and_the_next_call_works(shared):
    shared(2)
    blocks = np.ones((4, 8, 64), dtype=np.float32)
    with pytest.raises(ValueError):
        split.matmul(np.ones((2, 9), dtype=np.float32), blocks)      # K 9 against 8
    np.testing.assert_array_equal(split.matmul(np.ones((2, 8), dtype=np.float32), blocks),
                                  np.full((4, 2, 64), 8.0, dtype=np.float32))
