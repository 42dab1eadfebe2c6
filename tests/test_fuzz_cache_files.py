"""Fuzz targets for the files on disk (issue 45): the persisted cache's header and pages, and the
disk tier's pages. Whatever a header says, a load loads or refuses with one line naming the
field; whatever the disk does to a saved page or a tier page, that page is a miss and never a
wrong K/V.
Budgets are small (CI stays fast); raise max_examples locally to search longer.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine as dl
from app.cache_persist import FILE_NAME, PersistedCache

from .prefix_helpers import assert_session_sees, teardown
from .test_cache_persist_faults import big_cache
from .test_disk_tier_faults import demoted

FAST = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))

HEADER_FIELDS = ["format", "model_sha256", "page_rows", "kv_dtype", "arch", "kv_shape", "n_pages",
                 "index_bytes", "index_sha256", "saved_at", "something_else"]
_leaf = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
         | st.text(max_size=70) | st.sampled_from(["abc", "", "0" * 64, "float32", "llama"]))
_values = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
# JSON text: values (NaN and Infinity as Python writes them), huge literals, deep nesting
raw_values = (_values.map(json.dumps) | st.sampled_from(["1e400", "-1e400", "1" + "0" * 400, "-0"])
              | st.integers(1, 30_000).map(lambda n: "[" * n + "]" * n))


@pytest.fixture(scope="module")
def saved(tiny_model, tmp_path_factory):
    """A cache file of four 64-row pages of the tiny model, and the stand-in it came from."""
    src = big_cache(tiny_model, 2, 2)
    folder = tmp_path_factory.mktemp("fuzz-cache")
    assert PersistedCache(str(folder), src, io.StringIO()).save() == 4
    return src, (folder / FILE_NAME).read_bytes()


def _load(model, data: bytes):
    """Load `data` as a cache file into a fresh stand-in scheduler: (pages, lines, stand-in, file left)."""
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, FILE_NAME), "wb") as fh:
            fh.write(data)
        sch = SimpleNamespace(cache=dl.create_prefix_cache(), pool=dl.create_kv_pool(model, page_rows=64),
                              model=model)
        out = io.StringIO()
        n = PersistedCache(folder, sch, out).load()
        return n, out.getvalue().splitlines(), sch, os.path.exists(os.path.join(folder, FILE_NAME))


@FAST
@given(field=st.sampled_from(HEADER_FIELDS), raw=raw_values,
       flips=st.lists(st.integers(0, 10**6), max_size=3))
def test_fuzz_a_cache_header_loads_or_is_refused_by_name(tiny_model, saved, field, raw, flips):
    src, data = saved
    n = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16:16 + n])
    header[field] = "@@"
    head = bytearray(json.dumps(header).replace('"@@"', raw).encode())
    for at in flips:  # and a few bytes of the header's text flipped
        head[at % len(head)] ^= 0x20
    got, lines, sch, left = _load(tiny_model, data[:8] + len(head).to_bytes(8, "little") + bytes(head)
                                  + data[16 + n:])
    assert len(lines) == 1, lines
    if got:
        assert got == 4 and "loaded 4 page(s)" in lines[0] and left
        for key, entry in src.cache.pages.items():  # a load is the very pages saved
            np.testing.assert_array_equal(sch.pool.k[:, sch.cache.pages[key].page], src.pool.k[:, entry.page])
    else:
        assert "not loaded" in lines[0] and not left and len(sch.cache.pages) == 0
        if not flips:
            assert field in lines[0] or "header is corrupt" in lines[0], lines[0]


@FAST
@given(data=st.data())
def test_fuzz_a_damaged_saved_page_is_skipped_with_its_descendants_never_served(tiny_model, saved, data):
    src, blob = saved
    head = int.from_bytes(blob[8:16], "little")
    header = json.loads(blob[16:16 + head])
    start = 16 + head + header["index_bytes"]
    index = json.loads(blob[16 + head:start])["pages"]
    page_bytes = (len(blob) - start) // len(index)
    damaged = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 4))):  # bytes of the K/V changed, as a failing disk would
        damaged[data.draw(st.integers(start, len(blob) - 1))] ^= data.draw(st.integers(1, 255))
    bad = {i for i in range(len(index))
           if damaged[start + i * page_bytes:start + (i + 1) * page_bytes]
           != blob[start + i * page_bytes:start + (i + 1) * page_bytes]}
    served = set()  # the pages whose every ancestor and themselves are intact (parents come first)
    for i, (key, parent, *_rest) in enumerate(index):
        if i not in bad and (parent is None or parent in served):
            served.add(key)
    got, lines, sch, left = _load(tiny_model, bytes(damaged))
    assert got == len(served) and set(sch.cache.pages) == served and left
    assert len(lines) == 1 and f"loaded {len(served)} page(s)" in lines[0], lines
    assert (f"; {len(bad)} damaged page(s)" in lines[0]) == bool(bad), lines  # two flips of a byte may cancel
    for key in served:  # what loads is the very page saved
        np.testing.assert_array_equal(sch.pool.k[:, sch.cache.pages[key].page],
                                      src.pool.k[:, src.cache.pages[key].page])
        np.testing.assert_array_equal(sch.pool.v[:, sch.cache.pages[key].page],
                                      src.pool.v[:, src.cache.pages[key].page])


@FAST
@given(data=st.data())
def test_fuzz_a_damaged_tier_page_is_a_miss_never_a_wrong_page(data):
    tokens = list(range(100, 124))                        # six pages: one in the pool, five on disk
    pool, cache = demoted(tokens)
    tier = cache.tier
    fd = tier._file.fileno()
    size = os.fstat(fd).st_size
    before = os.pread(fd, size, 0)
    kind = data.draw(st.sampled_from(["bytes", "zeros", "truncate"]))
    if kind == "truncate":
        os.ftruncate(fd, data.draw(st.integers(0, size - 1)))
    else:
        at = data.draw(st.integers(0, size - 1))
        n = data.draw(st.integers(1, 64))
        payload = bytes(n) if kind == "zeros" else data.draw(st.binary(min_size=n, max_size=n))
        os.pwrite(fd, payload, at)
    after = os.pread(fd, size, 0)                        # shorter when truncated
    slot_bytes = pool.bytes_per_page                     # a slot holds one page record, K then V
    intact = 0      # pages after the pool's, root to leaf, whose slot still holds what was written
    for tp in sorted(tier.pages.values(), key=lambda tp: tp.depth):
        span = slice(tp.slot * slot_bytes, (tp.slot + 1) * slot_bytes)
        if after[span] != before[span]:
            break
        intact += 1
    s = dl.Session(pool=pool)
    n = dl.prefix_attach(cache, pool, s, tokens + [1])
    assert_session_sees(s, tokens[:n])                    # whatever was attached is exactly right
    assert n == 4 * (1 + intact)                          # up to the first damaged page, not past it
    teardown([s], cache, pool)
