"""engine/cpu/shared_matmul.py: a decode pass's column blocks shared with helper processes give the very
numbers one worker gives, from any thread; a helper that dies, fails or would read another
file costs only the sharing, never an answer; and helpers end with the engine's process."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from engine.cpu import shared_matmul
from engine.cpu.helper_process import DONE, SLEEPING, SPIN_S, TAKEN
from engine.cpu.weight_layout import BLOCKS, blocks_matmul, to_blocks

pytestmark = pytest.mark.skipif(not shared_matmul.SUPPORTED, reason="helpers run on x86-64 Linux only")


@pytest.fixture
def shared(monkeypatch):
    """Every matrix is big enough to share; each test starts and ends with no helpers."""
    monkeypatch.setattr(shared_matmul, "SHARE_BYTES", 0)
    monkeypatch.setattr(shared_matmul, "_files", [])
    monkeypatch.setattr(shared_matmul, "_disabled", "")
    shared_matmul.shutdown()
    yield shared_matmul.set_parts
    shared_matmul.set_parts(1)
    shared_matmul.shutdown()


def mapped(tmp_path, arrays: list[np.ndarray], name: str = "weights.bin") -> tuple[str, list[np.ndarray]]:
    """The arrays written to one file and read back through a read-only map of it, as the
    weight image maps its file; the map is shared with helpers."""
    path = str(tmp_path / name)
    with open(path, "wb") as fh:
        for a in arrays:
            fh.write(np.ascontiguousarray(a, dtype=np.float32).tobytes())
    with open(path, "rb") as fh:
        blob = np.frombuffer(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)
    shared_matmul.share_file(path, blob)
    views, at = [], 0
    for a in arrays:
        views.append(blob[at:at + a.nbytes].view(np.float32).reshape(a.shape))
        at += a.nbytes
    return path, views


def until_helpers(n: int, x: np.ndarray, blocks: np.ndarray, transposed: bool = False) -> None:
    """Shared matmuls until n helpers are up (they start in the background, ~0.2 s)."""
    deadline = time.monotonic() + 60
    while len(shared_matmul._pool_or_start().ready(n)) < n:
        assert time.monotonic() < deadline, "no helper came up"
        shared_matmul.matmul(x, blocks, transposed)
        time.sleep(0.01)


@pytest.mark.parametrize("kind", BLOCKS)
def test_shared_blocks_equal_one_worker_bit_for_bit(shared, tmp_path, kind):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 64 * 13), dtype=np.float32)
    _, (blocks,) = mapped(tmp_path, [to_blocks(w, kind)])             # [13, 96, 64] or [13, 64, 96]
    assert blocks.shape == ((13, 64, 96) if kind == "blocks_t" else (13, 96, 64))
    t = kind == "blocks_t"
    xs = {rows: rng.standard_normal((rows, 96), dtype=np.float32) for rows in (1, 2, 8, 28, 33, 64)}
    forms = [(rows, form) for rows in xs for form in (("pair", "gemv") if rows == 1 else ("pair",))]
    shared(1)
    alone = {(rows, form): blocks_matmul(xs[rows], blocks, form, t) for rows, form in forms}
    shared(3)
    until_helpers(2, xs[2], blocks, t)
    jobs = shared_matmul._pool.seq
    for rows, form in forms:
        np.testing.assert_array_equal(blocks_matmul(xs[rows], blocks, form, t), alone[rows, form])
        np.testing.assert_allclose(alone[rows, form], xs[rows] @ w, rtol=1e-4, atol=1e-4)
    assert shared_matmul._pool.seq == jobs + len(forms)                       # each one was shared


def test_arrays_outside_a_shared_file_and_prefill_passes_stay_whole(shared, tmp_path):
    rng = np.random.default_rng(2)
    _, (blocks,) = mapped(tmp_path, [rng.standard_normal((8, 64, 64), dtype=np.float32)])
    shared(2)
    x = rng.standard_normal((4, 64), dtype=np.float32)
    until_helpers(1, x, blocks)
    jobs = shared_matmul._pool.seq
    anonymous = np.array(blocks)                                      # same numbers, not in the file
    np.testing.assert_array_equal(shared_matmul.matmul(x, anonymous), shared_matmul.matmul(x, blocks))
    prefill = rng.standard_normal((shared_matmul.SHARE_ROWS + 1, 64), dtype=np.float32)
    np.testing.assert_array_equal(shared_matmul.matmul(prefill, blocks),
                                  np.matmul(prefill, anonymous).transpose(1, 0, 2).reshape(len(prefill), -1))
    assert shared_matmul._pool.seq == jobs + 1                                # only the file's decode rows


def test_a_prefill_over_transposed_blocks_is_one_gemm_over_them_side_by_side(shared, tmp_path, monkeypatch):
    """Transposed blocks side by side are W^T: a prefill pass reads them as one matrix (one GEMM,
    1.2x as fast as a GEMM per block), while decode rows go block by block, as they are shared."""
    rng = np.random.default_rng(6)
    w = rng.standard_normal((96, 64 * 5), dtype=np.float32)
    _, (blocks,) = mapped(tmp_path, [to_blocks(w, "blocks_t")])
    shared(1)
    per_block, real = [], shared_matmul.products
    monkeypatch.setattr(shared_matmul, "products", lambda x, *a: per_block.append(len(x)) or real(x, *a))
    prefill = rng.standard_normal((shared_matmul.SHARE_ROWS + 1, 96), dtype=np.float32)
    np.testing.assert_allclose(shared_matmul.matmul(prefill, blocks, True), prefill @ w, rtol=1e-4, atol=1e-4)
    assert per_block == []
    np.testing.assert_allclose(shared_matmul.matmul(prefill[:8], blocks, True), prefill[:8] @ w,
                               rtol=1e-4, atol=1e-4)
    assert per_block == [8]


def test_many_callers_at_once_each_get_their_own_answer(shared, tmp_path):
    """Two forward passes on two threads (the app's tour beside its worker): one shares, the
    others run whole; none reads another's output."""
    rng = np.random.default_rng(1)
    _, (blocks,) = mapped(tmp_path, [rng.standard_normal((24, 64, 64), dtype=np.float32)])
    shared(2)
    xs = [rng.standard_normal((4, 64), dtype=np.float32) for _ in range(4)]
    until_helpers(1, xs[0], blocks)
    want = [np.matmul(x, blocks).transpose(1, 0, 2).reshape(4, -1) for x in xs]
    bad = []

    def run(i):
        for _ in range(200):
            if not np.array_equal(shared_matmul.matmul(xs[i], blocks), want[i]):
                bad.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


@pytest.mark.parametrize("kind", BLOCKS)
def test_the_helpers_read_the_next_matmul_ahead_and_it_gives_them_more_with_the_same_answer(
        shared, tmp_path, monkeypatch, kind):
    """A matmul names the pass's next one: once its share is done, a helper reads the first blocks
    of its share of that one, and that matmul then leaves it more (a block it read costs it
    CACHED_COST of one from memory). How many it reads grows by a block while it has finished
    before the next job comes, never past its share. A read-ahead of another matrix, or of an
    array outside the shared file, leaves the shares as they were; the answers never change."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((64, 64 * 9), dtype=np.float32)
    _, (wo, other, first) = mapped(tmp_path, [to_blocks(w, kind)] * 3)
    t = kind == "blocks_t"
    shared(2)
    monkeypatch.setattr(shared_matmul, "AHEAD_BYTES", wo[0].nbytes)          # a block first
    monkeypatch.setattr(shared_matmul, "PATIENCE_S", 10.0)                   # a helper asleep is waited for
    x = rng.standard_normal((1, 64), dtype=np.float32)
    want = shared_matmul.matmul(x, np.array(wo), t)                          # whole, in this thread
    np.testing.assert_allclose(want, x @ w, rtol=1e-4, atol=1e-4)
    until_helpers(1, x, wo, t)
    pool, helper = shared_matmul._pool, shared_matmul._pool.helpers[0]
    assert shared_matmul.shares(9, 1) == (0, 4, 9)
    assert shared_matmul.shares(9, 1, cached=7) == (0, 2, 9)         # 7 blocks from the helper's cache
    assert shared_matmul.shares(9, 1, cached=7, rows=8) == (0, 3, 9)         # eight rows' arithmetic stays
    key = ((wo.shape, t), 1)                                         # what the tuning is kept by
    for ahead in (wo, other, np.array(wo), None):
        shared_matmul.matmul(x, first, t, then=ahead)
        time.sleep(0.01)                                             # the helper has read it by now
        read, jobs = pool.tuned.get(key, 0), pool.seq
        assert helper.slot[shared_matmul.AHEAD_READ] == jobs
        np.testing.assert_array_equal(shared_matmul.matmul(x, wo, t), want)
        assert pool.seq == jobs + 1
        if ahead is wo:
            assert (read, pool.tuned[key]) == (1, 2)                 # one block, then two: it had finished
        else:
            assert pool.tuned.get(key, 0) == read                    # nothing read ahead of wo
    reads = []
    for _ in range(12):                                              # it grows to its share, no further
        shared_matmul.matmul(x, first, t, then=wo)
        reads.append(pool.read[1])                                   # blocks it reads ahead
        time.sleep(0.01)
        np.testing.assert_array_equal(shared_matmul.matmul(x, wo, t), want)
    assert reads[:6] == [2, 3, 4, 5, 6, 7] and set(reads[6:]) == {8} == {9 - shared_matmul.shares(9, 1, 8)[1]}
    prefill = rng.standard_normal((shared_matmul.SHARE_ROWS + 1, 64), dtype=np.float32)
    shared_matmul.matmul(prefill, first, t, then=wo)                 # prefill shares nothing, reads nothing
    assert pool.read is None


@pytest.mark.parametrize("kind", BLOCKS)
def test_the_next_matmul_is_posted_before_its_input_and_the_helper_starts_it_at_once(
        shared, tmp_path, monkeypatch, kind):
    """Once a pass has run, its next matmul's job goes to the helper while the helper ends this
    one, so it has the job before its input is in (asleep meanwhile, the input wakes it). A
    different matmul coming instead costs nothing; the answers never change."""
    monkeypatch.setattr(shared_matmul, "PATIENCE_S", 10.0)   # a late helper is waited for, never skipped
    rng = np.random.default_rng(6)
    t = kind == "blocks_t"
    # K = 1024: the caller's own share (4 blocks, 1 MB) outlasts a spinning helper's start by far
    ws = [rng.standard_normal((1024, 64 * 9), dtype=np.float32) for _ in range(3)]
    _, (a, b, c) = mapped(tmp_path, [to_blocks(w, kind) for w in ws])
    Site = shared_matmul.Site
    first, then, other = Site(a, t, b), Site(b, t, a), Site(c, t)  # a, b, a, b, ...
    x = rng.standard_normal((1, 1024), dtype=np.float32)
    want = [shared_matmul.matmul(x, np.array(blocks), t) for blocks in (a, b, c)]  # whole, in this thread
    np.testing.assert_allclose(want[0], x @ ws[0], rtol=1e-3, atol=1e-3)
    shared(2)
    until_helpers(1, x, a, t)
    pool, slot = shared_matmul._pool, shared_matmul._pool.helpers[0].slot
    deadline = time.monotonic() + 60

    def holds(job: int) -> None:                                     # the helper has read that job
        while slot[shared_matmul.STARTED] != job:
            assert time.monotonic() < deadline, "the helper never took up the posted job"
            time.sleep(0.001)

    def runs() -> None:                                              # until `first`'s job is posted early
        while pool.pending is None or pool.pending[0] is not first:
            assert time.monotonic() < deadline, "no job was posted before its input"
            shared_matmul.matmul_site(x, first)
            shared_matmul.matmul_site(x, then)

    runs()
    assert first.next is then and then.next is first                 # what follows each, learned
    for step in range(6):
        holds(pool.pending[1])
        np.testing.assert_array_equal(shared_matmul.matmul_site(x, first), want[0])
        assert pool.pending[0] is then                               # posted before its input
        job = pool.pending[1]
        holds(job)                                                   # the helper holds it already
        if step == 3:
            while not slot[SLEEPING]:                                # and falls asleep waiting
                assert time.monotonic() < deadline, "the helper never went to sleep"
                time.sleep(SPIN_S)
        if step == 4:                                                # another matmul comes instead
            np.testing.assert_array_equal(shared_matmul.matmul_site(x, other), want[2])
            assert slot[DONE] == pool.seq > job                      # the helper did that one
            runs()
            continue
        np.testing.assert_array_equal(shared_matmul.matmul_site(x, then), want[1])
        assert slot[DONE] == job                                     # the helper did its share


def test_a_helper_that_dies_costs_the_sharing_not_the_answer(shared, tmp_path):
    rng = np.random.default_rng(3)
    _, (blocks,) = mapped(tmp_path, [rng.standard_normal((16, 64, 64), dtype=np.float32)])
    shared(2)
    x = rng.standard_normal((2, 64), dtype=np.float32)
    want = np.matmul(x, np.array(blocks)).transpose(1, 0, 2).reshape(2, -1)
    until_helpers(1, x, blocks)
    helper = shared_matmul._pool.helpers[0].proc
    os.kill(helper.pid, 9)
    helper.wait()
    np.testing.assert_array_equal(shared_matmul.matmul(x, blocks), want)     # the caller took its share
    assert "died" in shared_matmul._disabled and shared_matmul._pool is None
    np.testing.assert_array_equal(shared_matmul.matmul(x, blocks), want)     # and goes on alone


def test_a_helper_that_cannot_run_never_stalls_the_caller(shared, tmp_path):
    """A helper whose core another thread took (here: stopped outright) holds up nothing: the
    caller takes its shares back, mid-job too, and the helper's late copies are never read."""
    rng = np.random.default_rng(5)
    _, (blocks,) = mapped(tmp_path, [rng.standard_normal((16, 64, 64), dtype=np.float32)])
    shared(2)
    xs = [rng.standard_normal((2, 64), dtype=np.float32) for _ in range(6)]
    wants = [np.matmul(x, np.array(blocks)).transpose(1, 0, 2).reshape(2, -1) for x in xs]
    until_helpers(1, xs[0], blocks)
    helper = shared_matmul._pool.helpers[0].proc
    got: list[np.ndarray] = []
    os.kill(helper.pid, signal.SIGSTOP)
    try:
        worker = threading.Thread(target=lambda: got.extend(shared_matmul.matmul(x, blocks) for x in xs * 50))
        worker.start()
        worker.join(60)
        assert not worker.is_alive(), "a stopped helper stalled the caller"
    finally:
        os.kill(helper.pid, signal.SIGCONT)
    for i, g in enumerate(got):
        np.testing.assert_array_equal(g, wants[i % len(xs)])
    for x, want in zip(xs * 50, wants * 50):  # running again, it shares, and stale jobs are not read
        np.testing.assert_array_equal(shared_matmul.matmul(x, blocks), want)
    assert not shared_matmul._disabled and shared_matmul._pool.helpers[0].proc is helper


def test_a_sleeping_helper_wakes_for_the_next_job_and_does_it(shared, tmp_path, monkeypatch):
    """A helper idle past SPIN_S sleeps (on an eventfd, engine/cpu/shared_matmul.py), and the next job wakes
    it: it computes its share rather than the caller taking it back."""
    monkeypatch.setattr(shared_matmul, "PATIENCE_S", 10.0)   # the caller waits for it as long as it takes
    rng = np.random.default_rng(9)
    _, (blocks,) = mapped(tmp_path, [rng.standard_normal((16, 64, 64), dtype=np.float32)])
    x = rng.standard_normal((2, 64), dtype=np.float32)
    shared(2)
    until_helpers(1, x, blocks)
    slot = shared_matmul._pool.helpers[0].slot
    for _ in range(3):
        deadline = time.monotonic() + 30
        while not slot[SLEEPING]:                    # asleep
            assert time.monotonic() < deadline, "the helper never went to sleep"
            time.sleep(SPIN_S)
        want = np.matmul(x, np.array(blocks)).transpose(1, 0, 2).reshape(2, -1)
        np.testing.assert_array_equal(shared_matmul.matmul(x, blocks), want)
        assert slot[DONE] == shared_matmul._pool.seq and slot[TAKEN] != shared_matmul._pool.seq  # done by it


def test_a_file_replaced_since_it_was_mapped_is_never_read_by_a_helper(shared, tmp_path):
    """The engine maps an image, then the image is rebuilt under the same name: a helper that
    maps it only now would read other numbers, so it refuses and the caller computes."""
    rng = np.random.default_rng(4)
    path, (blocks,) = mapped(tmp_path, [rng.standard_normal((16, 64, 64), dtype=np.float32)])
    x = rng.standard_normal((2, 64), dtype=np.float32)
    want = np.matmul(x, np.array(blocks)).transpose(1, 0, 2).reshape(2, -1)
    other = tmp_path / "new.bin"
    other.write_bytes(np.ones((16, 64, 64), dtype=np.float32).tobytes())
    os.replace(other, path)
    shared(2)
    deadline = time.monotonic() + 60
    while not shared_matmul._disabled:  # until a helper has refused (back to back: it stays awake for them)
        assert time.monotonic() < deadline
        np.testing.assert_array_equal(shared_matmul.matmul(x, blocks), want)
    assert "failed a job" in shared_matmul._disabled
    np.testing.assert_array_equal(shared_matmul.matmul(x, blocks), want)


def test_helpers_end_with_the_engines_process(tmp_path):
    """No helper outlives the process it serves: not after a normal exit, nor after a kill."""
    script = textwrap.dedent(f"""
        import mmap, os, sys, time
        import numpy as np
        from engine.cpu import shared_matmul
        shared_matmul.SHARE_BYTES = 0
        path = {str(tmp_path / "w.bin")!r}
        np.ones((8, 64, 64), dtype=np.float32).tofile(path)
        with open(path, "rb") as fh:
            blob = np.frombuffer(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)
        shared_matmul.share_file(path, blob)
        blocks = blob.view(np.float32).reshape(8, 64, 64)
        shared_matmul.set_parts(2)
        while not shared_matmul._pool_or_start().ready(1):
            shared_matmul.matmul(np.ones((2, 64), dtype=np.float32), blocks)
            time.sleep(0.01)
        print(shared_matmul._pool.helpers[0].proc.pid, flush=True)
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), 9)
    """)
    for how in ("exit", "kill"):
        proc = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True,
                              timeout=120, cwd=os.path.dirname(os.path.dirname(shared_matmul.__file__)))
        pid = int(proc.stdout.split()[0])
        deadline = time.monotonic() + 30
        while _alive(pid):
            assert time.monotonic() < deadline, f"helper {pid} outlived its engine ({how})"
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"     # a zombie has ended
    except OSError:
        return False
