"""The column-block layout: the weights' only copy gives x @ W for any batch, on one or two threads."""

from __future__ import annotations

import numpy as np
import pytest

from engine import column_blocks
from engine.column_blocks import ColumnBlocks, matmul, to_column_blocks


@pytest.fixture
def weight():
    return np.random.default_rng(0).standard_normal((96, 320), dtype=np.float32)  # [K, N]


@pytest.mark.parametrize("rows", [1, 2, 8, 40])
def test_blocks_multiply_like_the_plain_matrix_on_one_or_two_threads(weight, rows):
    x = np.random.default_rng(rows).standard_normal((rows, 96), dtype=np.float32)
    blocked = ColumnBlocks(to_column_blocks(weight))
    assert blocked.shape == weight.shape and blocked.nbytes == weight.nbytes
    try:
        column_blocks.set_ways(1)
        one = matmul(x, blocked)
        column_blocks.set_ways(2)
        two = matmul(x, blocked)
    finally:
        column_blocks.set_ways(1)
    np.testing.assert_allclose(one, x @ weight, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(one, two)  # the split changes who computes, never the result


def test_tied_head_rows_are_the_embedding(weight):
    blocked = ColumnBlocks(to_column_blocks(weight))
    rows = blocked.T
    assert rows.shape == (320, 96)
    ids = np.array([0, 63, 64, 319, 5])
    np.testing.assert_array_equal(rows[ids], weight.T[ids])
    np.testing.assert_array_equal(np.asarray(blocked), weight)


def test_a_width_that_is_not_a_multiple_of_64_stays_plain(weight):
    assert to_column_blocks(weight[:, :100]) is None
    x = np.ones((3, 96), dtype=np.float32)
    np.testing.assert_allclose(matmul(x, weight[:, :100]), x @ weight[:, :100], rtol=1e-5)


def test_a_forked_child_multiplies_without_the_parents_helper_thread(weight):
    import multiprocessing as mp
    blocked = ColumnBlocks(to_column_blocks(weight))
    x = np.ones((8, 96), dtype=np.float32)
    column_blocks.set_ways(2)
    try:
        with mp.get_context("fork").Pool(1) as pool:  # would hang on the missing helper
            got = pool.apply_async(matmul, (x, blocked)).get(timeout=60)
    finally:
        column_blocks.set_ways(1)
    np.testing.assert_allclose(got, x @ weight, rtol=1e-5, atol=1e-5)
