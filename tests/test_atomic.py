"""The one atomic write (engine/atomic.py): a failed write leaves the old file whole and no litter."""

from __future__ import annotations

import os

import pytest

from engine.atomic import WriteFailed, atomic_write, atomic_write_many
from engine.metrics import hit_rate


def test_a_writer_that_fails_leaves_the_old_file_and_no_temporary_file(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")

    def half(fh):
        fh.write(b"half of the new")
        raise ValueError("the source ran dry")

    with pytest.raises(ValueError, match="ran dry"):
        atomic_write(target, half)
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]
    assert atomic_write(target, lambda fh: fh.write(b"new")) == str(target)
    assert target.read_text() == "new" and os.listdir(tmp_path) == ["out.json"]


def test_many_files_are_renamed_only_once_all_are_written(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("old a")
    with pytest.raises(WriteFailed, match="missing") as info:
        atomic_write_many([(a, lambda fh: fh.write(b"new a")),
                           (tmp_path / "missing" / "b.csv", lambda fh: None)])
    assert "cannot write" in str(info.value) and a.read_text() == "old a"
    atomic_write_many([(a, lambda fh: fh.write(b"new a")), (b, lambda fh: fh.write(b"new b"))])
    assert (a.read_text(), b.read_text()) == ("new a", "new b")
    assert sorted(os.listdir(tmp_path)) == ["a.csv", "b.csv"]


def test_the_one_hit_rate_is_saved_over_saved_plus_computed():
    assert hit_rate(0, 0) == 0.0 and hit_rate(48, 16) == 0.75 and hit_rate(10, 0) == 1.0


def test_a_folder_replaces_the_old_one_only_when_it_is_complete(tmp_path):
    from engine.atomic import atomic_dir
    final = tmp_path / "image"
    final.mkdir()
    (final / "index.json").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(str(final)) as tmp:
        (tmp_path / tmp / "index.json").write_text("half")
        raise RuntimeError("the load was stopped")
    assert (final / "index.json").read_text() == "old" and os.listdir(tmp_path) == ["image"]
    with atomic_dir(str(final)) as tmp:
        (tmp_path / tmp / "index.json").write_text("new")
    assert (final / "index.json").read_text() == "new" and os.listdir(tmp_path) == ["image"]
