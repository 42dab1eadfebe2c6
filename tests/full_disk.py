"""A real full disk for tests: a small tmpfs (mounting one needs root; without it the test is
skipped, and the tests that simulate ENOSPC still run)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess

import pytest


@contextlib.contextmanager
def small_tmpfs(path, size: str = "16k"):
    """A tmpfs of `size` mounted on `path` while the block runs."""
    os.makedirs(path, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0777", "tmpfs", str(path)],
                              capture_output=True, text=True, timeout=30)
    except OSError as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def read_only(path) -> None:
    """Remount the tmpfs on `path` read-only."""
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True, timeout=30)


def fill(folder) -> None:
    """Write a file in `folder` until its filesystem says it is full."""
    with open(os.path.join(folder, "filler"), "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\xff" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
