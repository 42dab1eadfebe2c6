"""Atomic file writes: a temporary file beside the target, flushed to disk, then renamed over it.

A reader (or a crash) never sees half a file: the old file stays whole until the rename.
The one helper for reports, traces, watch snapshots, assembled model files and caches.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import typing
from collections.abc import Callable

Writer = Callable[[typing.BinaryIO], None]


class WriteFailed(OSError):
    """A file could not be written; `path` and `reason` say which and why."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"cannot write {path}: {reason}")
        self.path, self.reason = path, reason

    def __str__(self) -> str:
        return self.args[0]


def atomic_write_many(targets: list[tuple[str | os.PathLike, Writer]], mode: int = 0o644) -> list[str]:
    """Write each (path, write(fh)) into a temporary file beside its path, then rename them all
    (each with `mode`; the temporary file is 0600 while it is written).

    Nothing is renamed until every file is written, so a failure (an OSError, which becomes
    WriteFailed naming the path, or the writer's own exception) leaves the old files as they
    were and no temporary file behind. Returns the absolute paths.
    """
    paths = [os.path.abspath(os.fspath(p)) for p, _ in targets]
    temps: list[str] = []
    path = paths[0]
    try:
        for path, (_, write) in zip(paths, targets, strict=True):
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{os.path.basename(path)}.",
                                       suffix=".tmp")
            temps.append(tmp)
            with os.fdopen(fd, "wb") as fh:
                write(fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, mode)  # 0644: mkstemp's 0600 would hide a report from the user's other tools
        for path, tmp in zip(paths, temps, strict=True):
            os.replace(tmp, path)
        temps = []
    except WriteFailed:
        raise
    except OSError as e:
        raise WriteFailed(path, e.strerror or str(e)) from e
    finally:
        for tmp in temps:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return paths


def atomic_write(path: str | os.PathLike, write: Writer, mode: int = 0o644) -> str:
    """Write through `write(fh)` into a temporary file beside `path`, then rename it over `path`."""
    return atomic_write_many([(path, write)], mode)[0]


@contextlib.contextmanager
def atomic_dir(final: str):
    """A temporary folder beside `final` to fill; it replaces `final` when the block ends well.

    When the block raises, the temporary folder goes and `final` is left as it was.
    """
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(final))
    try:
        yield tmp
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
