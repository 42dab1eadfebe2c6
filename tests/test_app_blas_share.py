"""The desktop app's worker leaves one core's BLAS thread to the UI thread, and gives it back."""

from app.desktop import blas_share
from engine.cpu.blas_threads import blas_threads


def test_cap_is_every_core_but_one_and_at_least_one():
    assert blas_share.worker_blas_cap(1) == 1
    assert blas_share.worker_blas_cap(2) == 1
    assert blas_share.worker_blas_cap(16) == 15


def test_leave_core_caps_the_bandwidth_bound_passes_and_release_restores_them(monkeypatch):
    monkeypatch.setattr(blas_share, "usable_cores", lambda: 3)
    chooser = blas_threads()
    monkeypatch.setattr(chooser, "batch_cap", None)
    monkeypatch.setattr(chooser, "max_threads", 3)
    monkeypatch.setattr(chooser, "free", 3.0)
    monkeypatch.setattr(chooser, "pinned", None)
    monkeypatch.setattr(chooser, "_refresh", lambda: None)
    assert blas_share.leave_core_for_ui() == 2
    assert chooser.choose(rows=8) == 2       # a decode step waits for memory: one core to the UI
    assert chooser.choose(rows=1) == 3       # one row's GEMV and a prefill still use every core
    assert chooser.choose(rows=128) == 3
    blas_share.release_core()
    assert chooser.choose(rows=8) == 3
