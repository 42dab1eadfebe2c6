"""--persist-cache fails closed (issue 45): a header with a wrong field, a link to /dev/zero or a
FIFO is refused with one line naming what is wrong and moved aside; a full or read-only folder
at exit is one line; files are 0600; a load costs the file's size plus a constant."""

from __future__ import annotations

import errno
import io
import json
import os
import resource
import subprocess
import sys
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

import engine as dl
from app import cache_persist
from app.cache_persist import FILE_NAME, PersistedCache
from engine.prefix_records import ChainRecord

from .full_disk import fill, read_only, small_tmpfs
from .test_cache_persist import answered, refused, saved_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def with_header_field(path, field: str, raw: str) -> None:
    """Rewrite the cache file at `path` with its header's `field` set to the JSON text `raw`."""
    data = path.read_bytes()
    n = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16:16 + n])
    header[field] = "@@"
    head = json.dumps(header).replace('"@@"', raw).encode()
    path.write_bytes(data[:8] + len(head).to_bytes(8, "little") + head + data[16 + n:])


DEEP = "[" * 20_000 + "]" * 20_000


@pytest.mark.parametrize("field, raw, named", [
    ("n_pages", '"abc"', "n_pages"), ("n_pages", "null", "n_pages"), ("n_pages", "1e400", "n_pages"),
    ("n_pages", "-1", "n_pages"), ("n_pages", "true", "n_pages"), ("n_pages", "9" * 40, "n_pages"),
    ("n_pages", "3", "n_pages"), ("index_bytes", '"abc"', "index_bytes"),
    ("index_bytes", "1e400", "index_bytes"),
    ("index_sha256", "null", "index_sha256"), ("page_rows", "true", "page_rows"),
    ("kv_shape", "[2, 4, 2, 1e400]", "kv_shape"), ("format", '"2"', "format"),
    pytest.param("n_pages", DEEP, "header", id="nested-20000-deep"),
])
def test_a_header_field_of_the_wrong_type_or_size_is_refused_by_name(tiny_model, tmp_path, field, raw, named):
    saved_file(tiny_model, tmp_path)
    with_header_field(tmp_path / FILE_NAME, field, raw)
    line, _ = refused(tiny_model, tmp_path)
    assert named in line, line


def test_a_cache_file_is_private_and_leaves_no_temporary_file(tiny_model, tmp_path):
    saved_file(tiny_model, tmp_path)
    assert os.stat(tmp_path / FILE_NAME).st_mode & 0o777 == 0o600   # chains' previews are prompts
    assert os.listdir(tmp_path) == [FILE_NAME]


def test_a_killed_saves_temporary_file_is_removed_by_the_next_save(tiny_model, tmp_path):
    killed = tmp_path / f".{FILE_NAME}.k1ll3d.tmp"    # what SIGKILL mid-save leaves
    killed.write_bytes(b"half a cache")
    os.utime(killed, (0, 0))
    live = tmp_path / f".{FILE_NAME}.wr1t1n.tmp"       # another process's save, being written now
    live.write_bytes(b"a cache being written")
    saved_file(tiny_model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted([FILE_NAME, live.name])


LOAD = """
import io, sys
from engine import load_model
from engine.scheduler import Scheduler, SchedulerSettings
from app.cache_persist import PersistedCache
out = io.StringIO()
sch = Scheduler(load_model(sys.argv[1]), SchedulerSettings(page_rows=4))
n = PersistedCache(sys.argv[2], sch, out).load()
print(n, out.getvalue().strip())
"""


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


@pytest.mark.parametrize("kind", ["link to /dev/zero", "FIFO"])
def test_only_a_regular_file_is_read(tiny_gguf_path, tmp_path, kind):
    path = tmp_path / FILE_NAME
    if kind == "FIFO":
        os.mkfifo(path)        # opening it to read would wait for a writer for ever
    else:
        os.symlink("/dev/zero", path)   # reading it would never end
    # a subprocess with a memory limit and a timeout: the old reader hung or ate the memory
    done = subprocess.run([sys.executable, "-c", LOAD, tiny_gguf_path, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, preexec_fn=_limit_memory)
    assert done.returncode == 0, done.stderr
    n, line = done.stdout.split(" ", 1)
    assert n == "0" and "not loaded" in line and "moved to" in line, line
    assert ("symbolic link" if kind != "FIFO" else "not a regular file") in line
    assert not os.path.lexists(path)


def test_a_save_that_cannot_be_written_is_one_line_and_keeps_the_old_file(tiny_model, tmp_path, monkeypatch):
    old = saved_file(tiny_model, tmp_path)
    sch, kept, _, _ = answered(tiny_model, tmp_path, out=io.StringIO())
    pages = dict(sch.cache.pages)

    def full(fh, *args):
        fh.write(b"x" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(cache_persist, "write_cache", full)
    kept.out = io.StringIO()
    assert kept.save() == 0
    [line] = kept.out.getvalue().splitlines()
    assert "not saved" in line and "No space left on device" in line
    assert (tmp_path / FILE_NAME).read_bytes() == old and os.listdir(tmp_path) == [FILE_NAME]
    assert sch.cache.pages == pages                       # nothing lost from the running process


@pytest.mark.parametrize("how", ["full", "read-only"])
def test_a_full_or_read_only_tmpfs_at_exit_is_one_line(tiny_model, tmp_path, how):
    with small_tmpfs(tmp_path / "kv", "1m") as folder:
        old = saved_file(tiny_model, folder)
        if how == "full":
            fill(folder)
        else:
            read_only(folder)
        sch, kept, _, _ = answered(tiny_model, folder, out=io.StringIO())
        kept.out = io.StringIO()
        assert kept.save() == 0
        [line] = kept.out.getvalue().splitlines()
        assert "not saved" in line and ("No space" if how == "full" else "Read-only") in line, line
        assert (folder / FILE_NAME).read_bytes() == old
        assert not [f for f in os.listdir(folder) if f.endswith(".tmp")]
        assert len(sch.cache.pages) > 0


def big_cache(model, n_chains: int, depth: int):
    """A stand-in scheduler whose cache holds n_chains x depth random 64-row pages of `model`."""
    rng = np.random.default_rng(0)
    pool = dl.create_kv_pool(model, page_rows=64)
    cache = dl.create_prefix_cache()
    pages = []
    chains = [ChainRecord(id=c, n_tokens=0, pages_live=0, hits=0, preview=f"chain {c}", created_at=0.0)
              for c in range(n_chains)]
    for c in range(n_chains):
        parent = None
        for d in range(depth):
            toks = [int(t) for t in rng.integers(0, model.config.vocab_size, 64)]
            key = cache.page_key(parent, toks, "")
            pages.append((key, parent, toks, "", d, c))
            parent = key
    kv = rng.standard_normal((2, *pool.k[:, 0].shape)).astype(pool.k.dtype)

    def fill(i, page):
        pool.k[:, page] = kv[0] + i
        pool.v[:, page] = kv[1] - i
    assert cache.adopt(pool, pages, chains, fill) == len(pages)
    return SimpleNamespace(cache=cache, pool=pool, model=model)


def test_loading_costs_at_most_the_file_size_plus_a_constant(tiny_model, tmp_path):
    src = big_cache(tiny_model, 40, 8)                  # 320 pages of 32 KiB: a 10 MB file
    assert PersistedCache(str(tmp_path), src, io.StringIO()).save() == 320
    size = os.path.getsize(tmp_path / FILE_NAME)
    fresh = SimpleNamespace(cache=dl.create_prefix_cache(), pool=dl.create_kv_pool(tiny_model, page_rows=64),
                            model=tiny_model)
    tracemalloc.start()
    try:
        loaded = PersistedCache(str(tmp_path), fresh, io.StringIO()).load()
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert loaded == 320
    # beyond what the loaded cache keeps (its pages' records and index; the K/V are the pool's)
    assert peak - kept <= size + (1 << 20), f"a load of a {size:,}-byte file took {peak - kept:,} bytes more"
    key = next(iter(src.cache.pages))
    np.testing.assert_array_equal(fresh.pool.k[:, fresh.cache.pages[key].page],
                                  src.pool.k[:, src.cache.pages[key].page])
