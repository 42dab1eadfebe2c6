"""The desktop app's worker leaves one core's BLAS thread to the UI thread, and gives it back."""

import numpy as np  # noqa: F401 - threadpoolctl sees only the BLAS NumPy already loaded
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from app import blas_share


def blas_counts() -> list[int]:
    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


def test_cap_is_every_core_but_one_and_at_least_one():
    assert blas_share.worker_blas_cap(1) == 1
    assert blas_share.worker_blas_cap(2) == 1
    assert blas_share.worker_blas_cap(16) == 15


def test_leave_core_caps_blas_threads_and_release_restores_them(monkeypatch):
    monkeypatch.setattr(blas_share, "usable_cores", lambda: 3)
    monkeypatch.setattr(blas_share, "_before", None)
    chooser = blas_share._chooser()
    if chooser is not None:  # the engine re-sets the count per pass: the cap goes into its chooser
        monkeypatch.setattr(chooser, "max_threads", 3)
        assert blas_share.leave_core_for_ui() == 2 and chooser.max_threads == 2
        blas_share.release_core()
        assert chooser.max_threads == 3
        return
    with threadpool_limits(limits=3, user_api="blas"):
        if blas_counts() != [3]:
            pytest.skip("this BLAS keeps its own thread count here")
        assert blas_share.leave_core_for_ui() == 2
        assert blas_counts() == [2]
        blas_share.release_core()
        assert blas_counts() == [3]
