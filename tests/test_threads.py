"""BLAS threads fit the machine: never more than the cores other processes leave free."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from engine.cpu import blas_threads


def blas_count() -> int:
    return max(lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas")


@pytest.fixture
def machine(monkeypatch):
    """A clock and CPU counters the test moves: `busy` is every core's busy time, `own` ours."""
    state = {"now": 100.0, "busy": 1000.0, "own": 10.0, "load": 0.0}
    monkeypatch.setattr(blas_threads.time, "monotonic", lambda: state["now"])
    monkeypatch.setattr(blas_threads, "_busy_seconds", lambda: state["busy"])
    monkeypatch.setattr(blas_threads, "_own_seconds", lambda: state["own"])
    monkeypatch.setattr(blas_threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(blas_threads.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(blas_threads, "_load_average", lambda: state["load"])
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):  # conftest caps the suite at 1
        monkeypatch.delenv(name, raising=False)
    yield state


def advance(state, seconds: float, others_busy_cores: float, own_cores: float) -> None:
    state["now"] += seconds
    state["own"] += own_cores * seconds
    state["busy"] += (others_busy_cores + own_cores) * seconds


def test_threads_follow_the_free_cores(machine):
    before = blas_count()
    try:
        chooser = blas_threads.BlasThreads(max_threads=2)
        advance(machine, 1.0, others_busy_cores=0.0, own_cores=2.0)   # idle machine, we use both
        assert chooser.fit() == 2 and blas_count() == 2
        advance(machine, 1.0, others_busy_cores=1.0, own_cores=1.0)   # a compiler on one core
        assert chooser.fit() == 1 and blas_count() == 1
        advance(machine, 1.0, others_busy_cores=2.0, own_cores=0.5)   # both cores busy elsewhere
        assert chooser.fit() == 1 and blas_count() == 1
        advance(machine, 0.1, others_busy_cores=0.0, own_cores=2.0)   # too soon to re-read
        assert chooser.fit() == 1
        advance(machine, 1.0, others_busy_cores=0.0, own_cores=1.0)   # the others stopped
        assert chooser.fit() == 2 and blas_count() == 2
        chooser.pinned = 1                                           # the bench's diagnostic
        assert chooser.fit() == 1 and blas_count() == 1
    finally:
        threadpool_limits(before, user_api="blas")


def test_a_pass_on_another_thread_sets_blas_threads_too(machine):
    """The app's worker (and the server's) drive the engine off the main thread, after the main
    thread's passes (the layout probe, a bench's headless round) set BLAS's threads: the worker's
    prefill must still get every core, not the one its last decode pass left."""
    import threading

    before = blas_count()
    try:
        chooser = blas_threads.BlasThreads(max_threads=2)
        chooser.pinned = 1
        assert chooser.fit(rows=300) == 1 and blas_count() == 1      # on the main thread
        seen = []

        def worker():
            chooser.pinned = 2
            seen.append((chooser.fit(rows=300), blas_count()))

        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert seen == [(2, 2)]
        chooser.pinned = 1                                           # and back on the main thread
        assert chooser.fit(rows=300) == 1 and blas_count() == 1
    finally:
        threadpool_limits(before, user_api="blas")


def test_a_loaded_machine_gets_one_thread_from_the_first_pass(machine):
    machine["load"] = 5.0                                            # others keep both cores busy
    assert blas_threads.BlasThreads().choose() == 1                    # before any /proc/stat window
    machine["load"] = 0.2
    assert blas_threads.BlasThreads().choose() == 2


def test_the_users_thread_setting_is_a_cap(machine, monkeypatch):
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    chooser = blas_threads.BlasThreads()
    advance(machine, 1.0, others_busy_cores=0.0, own_cores=0.0)   # idle: still 1, as the user asked
    assert chooser.choose() == 1


def test_the_first_short_window_replaces_the_load_averages_guess(machine):
    machine["load"] = 1.5                    # the minute's average still counts our last run
    chooser = blas_threads.BlasThreads()
    assert chooser.choose() == 1             # nothing measured yet: the guess
    advance(machine, blas_threads.FIRST_SAMPLE_S + 0.01, others_busy_cores=0.0, own_cores=1.0)  # loading
    assert chooser.choose() == 2             # the machine is idle now: both cores
    advance(machine, blas_threads.FIRST_SAMPLE_S + 0.01, others_busy_cores=2.0, own_cores=0.0)
    assert chooser.choose() == 2             # later windows are the usual SAMPLE_S long


@pytest.mark.skipif(not __import__("engine.cpu.shared_matmul").cpu.shared_matmul.SUPPORTED,
                    reason="helpers run on x86-64 Linux")
def test_a_decode_pass_over_blocks_shares_them_with_helpers_not_blas_threads(machine):
    """A decode pass over column blocks runs BLAS on one thread and shares its blocks with a
    helper on the other free core (engine/cpu/shared_matmul.py), in the app too; a prefill, or a model read
    in the plain layout, gets BLAS's threads instead; a busy machine shares with nobody."""
    from engine.cpu import shared_matmul

    before = blas_count()
    try:
        chooser = blas_threads.BlasThreads(max_threads=2)
        chooser.batch_cap = 1
        advance(machine, 1.0, others_busy_cores=0.0, own_cores=1.0)
        for rows in (1, 8):
            assert chooser.fit(rows, blocks=True) == 1 and blas_count() == 1 and shared_matmul._parts == 2
        assert chooser.fit(rows=300, blocks=True) == 2 and blas_count() == 2 and shared_matmul._parts == 1
        assert chooser.fit(rows=1, blocks=False) == 2 and shared_matmul._parts == 1
        advance(machine, 1.0, others_busy_cores=1.0, own_cores=1.0)
        assert chooser.fit(rows=1, blocks=True) == 1 and shared_matmul._parts == 1
    finally:
        threadpool_limits(before, user_api="blas")
        shared_matmul.set_parts(1)


def test_another_process_busy_counts_as_others_and_this_ones_own_work_does_not():
    first = blas_threads.load_sample()
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass"
    subprocess.run([sys.executable, "-c", spin], check=True)     # another process keeps a core busy
    assert blas_threads.others_cores(first, blas_threads.load_sample()) > 0.5
    readings = []  # a shared machine's other work may take a core in one window, not in five
    while len(readings) < 5 and (not readings or readings[-1] >= 0.3):
        first, t = blas_threads.load_sample(), time.process_time()
        while time.process_time() - t < 0.4:                      # this process keeps a core busy
            pass
        readings.append(blas_threads.others_cores(first, blas_threads.load_sample()))
    assert min(readings) < 0.3, readings                          # its own core counted: >= 0.9 in each
