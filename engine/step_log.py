"""The engine's passes, logged: `prefixlab serve --step-log FILE` appends what each pass ran and
how long its step took, as JSON lines (the twin fits its step cost to them: docs/twin.md, §1).

A step is timed whole, as `prefixlab calibrate` times it (the scheduler's work and the sending of
events included), but under a server's own traffic and front end. The file opens with a header
line (how a prompt pass is padded and tiled here, the machine, the model); a restarted server
appends another, and each header's lines follow it. A pass's line holds its seconds, when it
started (seconds after its header: idle moments and the host's slow spells show between passes;
version 2 on) and, for each decoding stream and each prompt piece, (positions before it, rows).
"""

from __future__ import annotations

import json
import os
import threading
import time

from .loop import EngineLoop
from .scheduler import ModelRunner

FORMAT = "prefixlab-step-log"
VERSION = 2          # 2 added each pass's `start`
READS_VERSIONS = (1, VERSION)


class _PartsRunner(ModelRunner):
    """The model's pass, noting what each pass runs for the loop's timing."""

    parts: tuple | None = None

    def forward(self, batch):
        self.parts = batch.parts()
        return super().forward(batch)


def header(model) -> dict:
    """How this engine pads and tiles a prompt pass, on which machine, for which model: what a fit
    of its passes must know (the log's first line; `calibrate` names its fit the same way)."""
    from .attention import KEY_TILE, QUERY_TILE
    from .machine import cpu_model
    size = os.path.getsize(model.path) if os.path.exists(model.path) else 0
    return {"format": FORMAT, "version": VERSION, "prompt_pad_rows": model.backend.exact_rows,
            "attention_tile": [QUERY_TILE, KEY_TILE], "machine": f"{cpu_model()}, {os.cpu_count()} cores",
            "model": f"{os.path.basename(model.path)} ({size} bytes)", "model_path": model.path}


class StepLogLoop(EngineLoop):
    """An engine loop that appends each step that ran a pass to `path`. The file is opened before
    the model loads, so a path that cannot be written fails the start, not the first request."""

    def __init__(self, path: str):
        self._file = open(path, "a", encoding="utf-8", buffering=1)  # whole lines while serving
        self._file_lock = threading.Lock()
        self._runner: _PartsRunner | None = None
        self._since = time.perf_counter()   # the latest header's time: a pass's start counts from it
        super().__init__()

    def reset(self, model=None, settings=None, runner=None) -> None:
        if runner is not None:
            raise ValueError("StepLogLoop runs the model's own pass: it times that")
        self._runner = _PartsRunner(model) if model is not None else None
        super().reset(model, settings, self._runner)
        if model is not None:
            self._since = time.perf_counter()
            self._write(header(model))

    def step(self) -> None:
        runner = self._runner
        if runner is not None:
            runner.parts = None
        t0 = time.perf_counter()
        try:
            super().step()
        finally:
            seconds = time.perf_counter() - t0
            if runner is not None and runner.parts is not None:
                decode, pieces = runner.parts
                self._write({"seconds": seconds, "start": round(t0 - self._since, 6), "decode": decode,
                             "pieces": pieces})

    def stop(self) -> None:
        super().stop()
        with self._file_lock:
            self._file.close()

    def _write(self, obj: dict) -> None:
        with self._file_lock:
            if not self._file.closed:
                self._file.write(json.dumps(obj) + "\n")


class StepLogError(ValueError):
    """A step log that cannot be read; the message names the file and line."""


def _pairs(value, what: str) -> list[tuple[int, int]]:
    out = [(int(a), int(b)) for a, b in value]
    if any(a < 0 or b < 1 for a, b in out):
        raise ValueError(f"{what}: positions must be >= 0 and rows >= 1")
    return out


def read_step_log(path: str) -> list[tuple[dict, list[tuple[int, list, list, float, float | None]]]]:
    """[(header, [(byte offset, decode, pieces, seconds, start) of each pass after it])] in file
    order (start: None in a version 1 log)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as e:
        raise StepLogError(f"{path}: cannot read the step log: {e.strerror or e}") from None
    runs: list[tuple[dict, list]] = []
    offset = 0
    for n, text in enumerate(raw.split(b"\n"), 1):
        at, offset = offset, offset + len(text) + 1
        if not text.strip():
            continue
        where = f"{path}, line {n}"
        try:
            obj = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise StepLogError(f"{where}: not JSON ({getattr(e, 'msg', e)})") from None
        if not isinstance(obj, dict):
            raise StepLogError(f"{where}: expected a JSON object")
        if obj.get("format") == FORMAT:
            if obj.get("version") not in READS_VERSIONS:
                raise StepLogError(f"{where}: step log version {obj.get('version')!r}; this PrefixLab "
                                   f"reads versions {', '.join(map(str, READS_VERSIONS))}")
            runs.append((obj, []))
            continue
        if not runs:
            raise StepLogError(f"{where}: a pass before any header line (is this a `serve --step-log` file?)")
        try:
            seconds = float(obj["seconds"])
            start = float(obj["start"]) if runs[-1][0]["version"] > 1 else None
            passed = (at, _pairs(obj["decode"], "decode"), _pairs(obj["pieces"], "pieces"), seconds, start)
        except (KeyError, TypeError, ValueError) as e:
            raise StepLogError(f"{where}: a pass needs seconds, start (version 2), decode and pieces, "
                               f"each a list of [positions, rows] ({type(e).__name__}: {e})") from None
        if not seconds > 0 or not (passed[1] or passed[2]) or (start is not None and not start >= 0):
            raise StepLogError(f"{where}: a pass takes seconds > 0, starts at >= 0 s and runs a stream or a "
                               "piece")
        runs[-1][1].append(passed)
    return runs
