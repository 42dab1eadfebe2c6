"""Which weight layout this machine's BLAS runs fastest, measured once and kept with the weight image.

Three layouts, and only one is ever read (docs/design.md §11): "plain" ([K, N] for `x @ W`),
"blocks" ([N/64, K, 64] column blocks) and "blocks_t" (the same blocks transposed, [N/64, 64, K]);
a decode pass shares either kind of blocks with a helper process (engine/cpu/shared_matmul.py). Which wins
depends on the CPU's BLAS kernels. On a 2-core EPYC with
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
the faster form is kept with the layout. Transposed, the blocks feed BLAS other kernels: on
that Xeon the W8 burst's step costs 0.91x (the FFN's down projection, K = 1536, 0.78x) and a
lone stream's token 1.03x, so the burst's step came to 1.64-1.71x a lone stream's against
1.84-1.89x (interleaved runs); the probe keeps whichever kind of blocks makes a lone stream's
step plus a burst's cheaper. It reads the first layers of every copy; the losers' pages are
then given back.
"""

from __future__ import annotations

import functools
import json
import os
import time

import numpy as np

from ..atomic import atomic_write
from ..errors import ModelLoadError
from ..machine import blas_runtime, cpu_model
from . import shared_matmul
from .blas_threads import blas_threads, load_sample, others_cores
from .weight_image import read_json_object

LAYOUTS = ("plain", "blocks", "blocks_t")
BLOCKS = ("blocks", "blocks_t")  # the layouts a decode pass shares with its helpers
ONE_ROW = ("pair", "gemv")  # how one row reads the blocks (blocks_matmul); "pair" where not measured
COLUMN_BLOCK = 64
PROBE_BYTES = 192 << 20  # per layout: so the probe reads memory as decode does. With 96 MB, on a
#                          Xeon whose L3 holds much of the candidates' data, transposed blocks
#                          read one row 13% faster in the probe and 4% slower in decode
PROBE_ROUNDS = 4         # the fastest of interleaved rounds; the first round is a warm-up
SETTLE = 4               # matrices each pass reads unmeasured first (BLAS's idle threads spin
#                          ~1.5 ms after another pass, on the core the helper reads with)
BATCH_ROWS = 8           # the burst this project exists for: eight streams decoding together
BLOCKS_MIN_GAIN = 0.85   # blocks must make 8 rows this much cheaper, cost one row at most
BLOCKS_MAX_LOSS = 1.40   # this much more, and cost less for one row and eight together
BUSY_CORES = 0.25        # a probe during which other processes kept this much CPU busy is not kept
LAYOUT_FILE = "layout.json"
PROBE = "probe 4"         # what the probe measures: since 2, blocks shared with the decode helpers;
#                           since 3, one row over the blocks both ways; since 4, transposed blocks too
ENV = "PREFIXLAB_LAYOUT"  # a name in LAYOUTS forces it; "remeasure" measures again; unset or "auto"


def to_blocks(w: np.ndarray, layout: str = "blocks") -> np.ndarray | None:
    """w [..., K, N] as contiguous blocks of 64 columns: [..., N/64, K, 64] ("blocks"), or each
    transposed, [..., N/64, 64, K] ("blocks_t"); None when N % 64 != 0."""
    *lead, K, N = w.shape
    if N % COLUMN_BLOCK:
        return None
    cols = w.reshape(*lead, K, N // COLUMN_BLOCK, COLUMN_BLOCK)                # [..., K, N/64, 64]
    view = np.moveaxis(cols, -3, -1) if layout == "blocks_t" else cols.swapaxes(-3, -2)
    out = np.empty(view.shape, dtype=w.dtype)
    for i in np.ndindex(*lead):  # a matrix at a time: a stack's transposed copy in one go misses
        out[i] = view[i]         # the cache (30 layers of SmolLM2's gate+up: 0.56 s, 0.20 this way)
    return out


def blocks_matmul(x: np.ndarray, blocks: np.ndarray, one_row: str = "pair",
                  transposed: bool = False, then: np.ndarray | None = None) -> np.ndarray:
    """x [N, K] @ W given as blocks (to_blocks; `transposed` for "blocks_t"): [N, out]. A decode
    pass's blocks are shared with a helper process (engine/cpu/shared_matmul.py), which starts reading
    `then` (the pass's next matmul's blocks) once its share is done."""
    return site_matmul(x, shared_matmul.Site(blocks, transposed, then), one_row)


def site_matmul(x: np.ndarray, site: shared_matmul.Site, one_row: str = "pair") -> np.ndarray:
    """`blocks_matmul` of a prepared shared_matmul.Site. One row goes as `one_row` says, whichever the
    probe found faster here: "pair", as two rows (BLAS's small-matrix GEMM kernel), or "gemv",
    as itself (a GEMV per block)."""
    if len(x) == 1 and one_row == "pair":
        x2 = np.zeros((2, x.shape[1]), dtype=np.float32)                   # [2, K]
        x2[0] = x[0]
        return shared_matmul.matmul_site(x2, site)[:1]                             # [1, out]
    return shared_matmul.matmul_site(x, site)                                      # [N, out]


def plain_matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [N, K] @ w [K, N_out]; one row as a GEMV (reads the plain layout at full bandwidth)."""
    return (x[0] @ w)[None] if len(x) == 1 else x @ w                     # [N, out]


def machine_key() -> str:
    """What the measurement depends on: the CPU, the BLAS kernel and its threads, NumPy."""
    blas = blas_runtime()
    return (f"{cpu_model()} | {os.cpu_count()} cores | {blas.get('api')} {blas.get('version')} "
            f"{blas.get('core')} | numpy {np.__version__} | {PROBE}")


def probe_arrays(plain: dict[str, np.ndarray],
                 blocks: dict[str, dict[str, np.ndarray]]) -> dict[str, list[np.ndarray]]:
    """Each layout's first layers of the model's own matrices, PROBE_BYTES of them, in step
    order; `blocks` holds each kind of blocks (BLOCKS) by matrix name."""
    kinds = [k for k in BLOCKS if k in blocks]
    names = [n for n in plain if all(blocks[k].get(n) is not None for k in kinds)] if kinds else []
    per_layer = sum(plain[n][0].nbytes for n in names) or 1
    layers = range(min(len(plain[names[0]]), max(1, PROBE_BYTES // per_layer))) if names else range(0)
    copies = {"plain": plain, **{k: blocks[k] for k in kinds}}
    return {k: [copy[n][i] for i in layers for n in names] for k, copy in copies.items()}


def measure(arrays: dict[str, list[np.ndarray]]) -> dict:
    """Seconds of one pass over each layout's matrices, for 1 and 8 rows, and of one row over
    each kind of blocks as a GEMV ("blocks_1_gemv"; "blocks_1" goes as a pair): the fastest
    round (load only ever adds time), rounds interleaved so a burst of load hits every candidate alike."""
    passes = [("plain", "", plain_matmul, rows) for rows in (1, BATCH_ROWS)]  # (copy, key suffix, run, rows)
    mats = {"plain": arrays["plain"]}  # what each pass reads: the plain arrays, the blocks as decode's Sites
    for kind in (k for k in BLOCKS if k in arrays):
        mats[kind] = [shared_matmul.Site(w, kind == "blocks_t") for w in arrays[kind]]
        pair, gemv = (functools.partial(site_matmul, one_row=form) for form in ONE_ROW)
        passes += [(kind, "", pair, 1), (kind, "", pair, BATCH_ROWS), (kind, "_gemv", gemv, 1)]
    chooser = blas_threads()
    pinned = chooser.pinned
    chooser.pinned = pinned or chooser.max_threads  # every core, as on a quiet machine
    shared_matmul.warm(chooser.pinned)                      # blocks are read as decode reads them: shared
    times: dict[str, list[float]] = {}
    try:
        for rnd in range(PROBE_ROUNDS + 1):
            for copy, suffix, run, rows in passes:
                ws = mats[copy]
                ks = [w.K if copy in BLOCKS else w.shape[0] for w in ws]  # each matrix's K
                chooser.fit(rows, blocks=copy in BLOCKS)  # the threads a decode pass of it gets
                xs = {k: np.full((rows, k), 0.5, dtype=np.float32) for k in set(ks)}
                for w, k in zip(ws[:SETTLE], ks):
                    run(xs[k], w)
                t0 = time.perf_counter()
                for w, k in zip(ws, ks):
                    run(xs[k], w)
                if rnd:
                    times.setdefault(f"{copy}_{rows}{suffix}", []).append(time.perf_counter() - t0)
    finally:
        chooser.pinned = pinned
    return {k: min(v) for k, v in times.items()}


def one_row(times: dict, kind: str = "blocks") -> str:
    """How one row reads blocks of this kind here: "gemv" where it measured faster than as a pair."""
    inf = float("inf")
    return "gemv" if times.get(f"{kind}_1_gemv", inf) < times.get(f"{kind}_1", inf) else "pair"


def winner(times: dict) -> str:
    """The layout to keep: of the kinds of blocks measured, the one with which a lone stream's
    step plus a burst's costs least; kept only when it clearly speeds up the burst, that sum
    is less than with plain, and one stream loses at most BLOCKS_MAX_LOSS."""
    def one(kind: str) -> float:  # one row, in its faster form
        return min(times[f"{kind}_1"], times.get(f"{kind}_1_gemv", times[f"{kind}_1"]))
    kind = min((k for k in BLOCKS if f"{k}_8" in times), key=lambda k: one(k) + times[f"{k}_8"])
    gain = times[f"{kind}_8"] <= BLOCKS_MIN_GAIN * times["plain_8"]
    loss = one(kind) <= BLOCKS_MAX_LOSS * times["plain_1"]
    both = one(kind) + times[f"{kind}_8"] < times["plain_1"] + times["plain_8"]
    return kind if gain and loss and both else "plain"


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
    known = read_json_object(path)
    mine = known.get(key)
    if (not remeasure and isinstance(mine, dict) and mine.get("layout") in LAYOUTS
            and mine.get("one_row") in ONE_ROW):
        return mine["layout"], {**mine, "source": "remembered"}
    t0, load0 = time.perf_counter(), load_sample()
    times = {k: round(v, 6) for k, v in measure(arrays).items()}  # decided on what the record says
    others = others_cores(load0, load_sample())
    chosen = winner(times)
    record = {"layout": chosen, "one_row": one_row(times, chosen), "seconds": times,
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


