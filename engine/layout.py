"""Which weight layout this machine's BLAS runs fastest, measured once and kept with the weight image.

Two layouts, and only one is ever read (docs/design.md §11): "plain" ([K, N] for `x @ W`) and
"blocks" ([N/64, K, 64] column blocks, a decode pass's shared with a helper process,
engine/split.py). Which wins depends on the CPU's BLAS kernels. On a 2-core EPYC with
OpenBLAS's SkylakeX kernels the blocks won both ways: a decode step of 8 rows took 28 ms
against 60 as plain GEMMs, and one row 18.6 ms against the plain GEMV's 20.1. On a 2-core
Sapphire Rapids Xeon with the same kernels the plain GEMV reads faster (one row's matmuls
1.24-1.35x cheaper in the probe, a whole token 1.15x) while its 8-row GEMMs pack every weight
(0.55-0.6x as fast as the blocks; the 8-stream step 3.1x one stream's against 1.6x over the
blocks). So the engine measures both on the model's own matrix shapes (well under a second),
the blocks shared with the helper as a decode pass shares them, the first time it maps an
image on a machine, and keeps the answer in the image's folder. The blocks win when they make
the burst this project exists for clearly cheaper, and a lone stream's step plus a burst's
costs less than with plain. One row over the blocks is timed both as a pair of rows (the
GEMM kernel, faster on the EPYC where the blocks were first measured) and as a GEMV per block
(18 against 14 GB/s a core on the Xeon, where it then reads as fast as the plain GEMV), and
the faster form is kept with the layout. The probe reads the first layers of both
copies; the loser's pages are then given back.
"""

from __future__ import annotations

import functools
import json
import os
import time

import numpy as np

from . import split
from .atomic import atomic_write
from .errors import ModelLoadError
from .machine import blas_runtime, cpu_model
from .threads import blas_threads, load_sample, others_cores

LAYOUTS = ("plain", "blocks")
ONE_ROW = ("pair", "gemv")  # how one row reads the blocks (blocks_matmul); "pair" where not measured
COLUMN_BLOCK = 64
PROBE_BYTES = 96 << 20   # per layout: thrice a 32 MB L3, so the probe reads memory as decode does
PROBE_ROUNDS = 7         # medians of interleaved rounds; the first round is a warm-up
BATCH_ROWS = 8           # the burst this project exists for: eight streams decoding together
BLOCKS_MIN_GAIN = 0.85   # blocks must make 8 rows this much cheaper, cost one row at most
BLOCKS_MAX_LOSS = 1.40   # this much more, and cost less for one row and eight together
BUSY_CORES = 0.25        # a probe during which other processes kept this much CPU busy is not kept
LAYOUT_FILE = "layout.json"
PROBE = "probe 3"         # what the probe measures: since 2, blocks shared with the decode helpers;
#                           since 3, one row over the blocks both ways
ENV = "PREFIXLAB_LAYOUT"  # "plain" or "blocks" forces one; "remeasure" measures again; unset or "auto"


def to_column_blocks(w: np.ndarray) -> np.ndarray | None:
    """w [..., K, N] as [..., N/64, K, 64] contiguous column blocks; None when N % 64 != 0."""
    *lead, K, N = w.shape
    if N % COLUMN_BLOCK:
        return None
    return np.ascontiguousarray(w.reshape(*lead, K, N // COLUMN_BLOCK, COLUMN_BLOCK).swapaxes(-3, -2))


def blocks_matmul(x: np.ndarray, blocks: np.ndarray, one_row: str = "pair") -> np.ndarray:
    """x [N, K] @ W given as blocks [N/64, K, 64]: [N, out]. One row goes as `one_row` says,
    whichever the probe found faster here: "pair", as two rows (BLAS's small-matrix GEMM kernel),
    or "gemv", as itself (a GEMV per block). A decode pass's blocks are shared with a helper
    process (engine/split.py)."""
    if len(x) == 1 and one_row == "pair":
        x2 = np.zeros((2, x.shape[1]), dtype=np.float32)                   # [2, K]
        x2[0] = x[0]
        return split.matmul(x2, blocks)[:1]                                # [1, out]
    return split.matmul(x, blocks)                                         # [N, out]


def plain_matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [N, K] @ w [K, N_out]; one row as a GEMV (reads the plain layout at full bandwidth)."""
    return (x[0] @ w)[None] if len(x) == 1 else x @ w                     # [N, out]


def machine_key() -> str:
    """What the measurement depends on: the CPU, the BLAS kernel and its threads, NumPy."""
    blas = blas_runtime()
    return (f"{cpu_model()} | {os.cpu_count()} cores | {blas.get('api')} {blas.get('version')} "
            f"{blas.get('core')} | numpy {np.__version__} | {PROBE}")


def probe_arrays(plain: dict[str, np.ndarray], blocks: dict[str, np.ndarray]) -> dict[str, list[np.ndarray]]:
    """Each layout's first layers of the model's own matrices, PROBE_BYTES of them, in step order."""
    names = [n for n in plain if blocks.get(n) is not None]
    per_layer = sum(plain[n][0].nbytes for n in names) or 1
    layers = range(min(len(plain[names[0]]), max(1, PROBE_BYTES // per_layer))) if names else range(0)
    return {"plain": [plain[n][i] for i in layers for n in names],
            "blocks": [blocks[n][i] for i in layers for n in names]}


def measure(arrays: dict[str, list[np.ndarray]]) -> dict:
    """Seconds of one pass over each layout's matrices, for 1 and 8 rows, and of one row over the
    blocks as a GEMV ("blocks_1_gemv"; "blocks_1" goes as a pair): the fastest round (load only
    ever adds time), rounds interleaved so a burst of load hits every candidate alike."""
    passes = (("plain", "", plain_matmul, (1, 1, BATCH_ROWS)),     # (copy, key suffix, run, rows)
              ("blocks", "", functools.partial(blocks_matmul, one_row="pair"), (1, 1, BATCH_ROWS)),
              ("blocks", "_gemv", functools.partial(blocks_matmul, one_row="gemv"), (1, 1)))
    chooser = blas_threads()
    pinned = chooser.pinned
    chooser.pinned = pinned or chooser.max_threads  # every core, as on a quiet machine
    split.warm(chooser.pinned)                      # blocks are read as decode reads them: shared
    times: dict[str, list[float]] = {}
    try:
        for rnd in range(PROBE_ROUNDS + 1):
            for copy, suffix, run, rows_each in passes:
                ws = arrays[copy]
                # the first pass of each candidate only settles its threads (BLAS's idle ones spin
                # ~1.5 ms after the other layout's passes, on the core the helper reads with) and caches
                for i, rows in enumerate(rows_each):
                    chooser.fit(rows, blocks=copy == "blocks")  # the threads a decode pass of it gets
                    xs = {k: np.full((rows, k), 0.5, dtype=np.float32) for k in {w.shape[-2] for w in ws}}
                    t0 = time.perf_counter()
                    for w in ws:
                        run(xs[w.shape[-2]], w)
                    if rnd and i:
                        times.setdefault(f"{copy}_{rows}{suffix}", []).append(time.perf_counter() - t0)
    finally:
        chooser.pinned = pinned
    return {k: min(v) for k, v in times.items()}


def one_row(times: dict) -> str:
    """How one row reads the blocks here: "gemv" where it measured faster than as a pair."""
    return "gemv" if times.get("blocks_1_gemv", float("inf")) < times["blocks_1"] else "pair"


def winner(times: dict) -> str:
    """The layout to keep: blocks only when they clearly speed up the burst, a lone stream's
    step plus a burst's costs less, and one stream loses at most BLOCKS_MAX_LOSS."""
    b1 = min(times["blocks_1"], times.get("blocks_1_gemv", times["blocks_1"]))  # its faster form
    gain = times["blocks_8"] <= BLOCKS_MIN_GAIN * times["plain_8"]
    loss = b1 <= BLOCKS_MAX_LOSS * times["plain_1"]
    both = b1 + times["blocks_8"] < times["plain_1"] + times["plain_8"]
    return "blocks" if gain and loss and both else "plain"


def choose(folder: str | None, arrays: dict[str, list[np.ndarray]]) -> tuple[str, dict]:
    """(layout, record): forced by $PREFIXLAB_LAYOUT, else remembered in `folder` for this
    machine, else measured now on `arrays` (probe_arrays: views, read only when measured) and
    remembered, unless other processes kept more than BUSY_CORES busy meanwhile (an unwritable
    folder only costs a re-measure)."""
    forced = os.environ.get(ENV, "auto").strip().lower()
    if forced in LAYOUTS:  # not measured: one row goes as a pair, as it long did everywhere
        return forced, {"layout": forced, "one_row": "pair", "source": f"${ENV}"}
    if forced not in ("auto", "remeasure"):
        raise ModelLoadError(f"${ENV}: expected auto, remeasure, plain or blocks, got {forced!r}")
    remeasure = forced == "remeasure"
    key, path = machine_key(), os.path.join(folder, LAYOUT_FILE) if folder else None
    known = _read(path)
    mine = known.get(key)
    if (not remeasure and isinstance(mine, dict) and mine.get("layout") in LAYOUTS
            and mine.get("one_row") in ONE_ROW):
        return mine["layout"], {**mine, "source": "remembered"}
    t0, load0 = time.perf_counter(), load_sample()
    times = {k: round(v, 6) for k, v in measure(arrays).items()}  # decided on what the record says
    others = others_cores(load0, load_sample())
    record = {"layout": winner(times), "one_row": one_row(times), "seconds": times,
              "probe_s": round(time.perf_counter() - t0, 3), "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
              "others_cores": None if others is None else round(others, 2)}
    # another process took cores from the candidates (a build during a first start picked plain
    # here, 3x slower for the burst): such a choice serves this run, and the next start measures again
    busy = others is not None and others > BUSY_CORES
    if path and not busy:
        known[key] = record
        try:
            atomic_write(path, lambda fh: fh.write(json.dumps(known, indent=1).encode()))
        except OSError:
            pass
    return record["layout"], {**record, "source": "measured", "kept": not busy}


def _read(path: str | None) -> dict:
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}
