"""Bench section "Engine core": prefill and decode against this machine's own NumPy limits,
batched decode, cold and warm load, and peak RSS (load + generate in a child process).

Every ratio divides two numbers measured in this one process, interleaved rep by rep and
each taken as the best of its reps, so a noisy shared machine moves both sides together.
Run `python -m app.bench.engine --child ...` only through `load_figures`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from threadpoolctl import threadpool_limits

import engine as dl
from engine.cpu.blas_threads import blas_threads as engine_blas_threads

from ..scenario import sample_tokens
from .common import child_env, figure, peak_rss_mb, ratio, target

FEATURE = "engine"  # the table's and the JSON's "feature" of its figures
BW_BYTES = 512 * 1024 ** 2  # the bandwidth probe reads a float32 array this large


# FLOP counting --------------------------------------------------------------------------
def layer_matmul_params(w) -> int:
    """Weights one token multiplies through in one block (QKV, O, gate+up, down)."""
    return sum(int(np.prod(a.shape[1:])) for a in (w.wqkv, w.wo, w.w_gate_up, w.w_down))


def prefill_flops(m, n: int) -> dict:
    """FLOPs a fresh prefill of n tokens must do: matmuls, causal attention, one logits row.

    Attention counts only the causal half (query i sees i+1 keys) for QK^T and PV; the
    engine computes the full square and masks it, which is its overhead, not useful work.
    """
    cfg, w = m.config, m.weights
    matmul = 2 * n * cfg.n_layers * layer_matmul_params(w)
    attention = cfg.n_layers * 2 * (2 * cfg.n_heads * cfg.head_dim * n * (n + 1) // 2)
    logits = 2 * int(np.prod(w.output.shape))
    return {"matmul": matmul, "attention": attention, "logits": logits,
            "total": matmul + attention + logits}


class GemmReference:
    """The forward pass's four GEMMs for n tokens on random float32 data of the model's shapes."""

    def __init__(self, m, n: int, n_sets: int, seed: int = 0):
        w = m.weights
        rng = np.random.default_rng(seed)
        d, q, ff = w.wqkv.shape[1], w.wo.shape[1], w.w_down.shape[1]
        self.n_layers = m.config.n_layers
        self.x = rng.standard_normal((n, d), dtype=np.float32)     # [n, d]
        self.a = rng.standard_normal((n, q), dtype=np.float32)     # [n, q_dim]: attention output
        self.h = rng.standard_normal((n, ff), dtype=np.float32)    # [n, ff]
        # Distinct weight sets cycled over the layers so one layer's weights are not simply
        # cache-resident every time, as they would not be in the model.
        shapes = [a.shape[1:] for a in (w.wqkv, w.wo, w.w_gate_up, w.w_down)]
        self.sets = [[rng.standard_normal(s, dtype=np.float32) * 0.05 for s in shapes]
                     for _ in range(max(1, min(n_sets, self.n_layers)))]
        self.flops = 2 * n * self.n_layers * sum(int(np.prod(s)) for s in shapes)
        self.shapes = {"tokens": n, "wqkv": list(shapes[0]), "wo": list(shapes[1]),
                       "w_gate_up": list(shapes[2]), "w_down": list(shapes[3])}

    def run(self) -> None:
        x, a, h = self.x, self.a, self.h
        for layer in range(self.n_layers):
            wqkv, wo, wgu, wd = self.sets[layer % len(self.sets)]
            x @ wqkv   # [n, q_dim + 2kv]
            a @ wo     # [n, d]
            x @ wgu    # [n, 2ff]
            h @ wd     # [n, d]


def bandwidth_probe():
    """A >= 512 MB float32 matrix and a GEMV over it: one full read of the matrix per call, on
    every core the engine may use (the machine's limit, whatever the last pass chose: a decode
    pass over column blocks runs BLAS on one thread beside its helpers, engine/cpu/shared_matmul.py)."""
    cols = 8192
    rows = BW_BYTES // (4 * cols)
    a = np.full((rows, cols), 0.5, dtype=np.float32)  # [rows, cols]; values do not matter to a read
    x = np.ones(cols, dtype=np.float32)                                              # [cols]
    cores = engine_blas_threads().max_threads

    def read() -> float:
        with threadpool_limits(limits=cores, user_api="blas"):
            return _timed(lambda: a @ x)  # [rows]

    return a.nbytes, read


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# prefill ---------------------------------------------------------------------------------
def prefill_figures(m, quick: bool) -> tuple[dict, dict]:
    n = 32 if quick else 256
    reps = 2 if quick else 4
    prompt = sample_tokens(m, n)
    pool = dl.create_kv_pool(m)
    ref = GemmReference(m, n, n_sets=1 if quick else 8)

    def prefill() -> None:
        s = dl.create_session(m, pool)
        dl.eval(m, s, prompt)
        s.release()

    prefill()   # warm-up: pool pages, first touch of the weights
    ref.run()
    t_model, t_ref = [], []
    for _ in range(reps):  # interleaved so noise from other processes hits both sides alike
        t_ref.append(_timed(ref.run))
        t_model.append(_timed(prefill))
    flops = prefill_flops(m, n)
    model_flop_s = flops["total"] / min(t_model)
    ref_flop_s = ref.flops / min(t_ref)
    figures = {
        "prefill_tok_s": figure(n / min(t_model), "tok/s", FEATURE, note=f"{n}-token prompt, best of {reps}"),
        "prefill_gflop_s": figure(model_flop_s / 1e9, "GFLOP/s", FEATURE),
        "matmul_ref_gflop_s": figure(ref_flop_s / 1e9, "GFLOP/s", FEATURE,
                                     note="NumPy GEMMs at the model's shapes, same process"),
        "prefill_flops_fraction": figure(ratio(model_flop_s, ref_flop_s), "ratio", FEATURE,
                                         **target("prefill_flops_fraction")),
    }
    details = {"prompt_tokens": n, "reps": reps, "model_flops": flops, "ref_flops": ref.flops,
               "ref_shapes": ref.shapes, "ref_weight_sets": len(ref.sets),
               "prefill_s": t_model, "ref_s": t_ref}
    return figures, details


# decode ----------------------------------------------------------------------------------
def _argmax_rows(logits: np.ndarray) -> list[int]:
    return [int(i) for i in np.argmax(logits.reshape(-1, logits.shape[-1]), axis=-1)]


def decode_figures(m, quick: bool, batch_streams: int = 8, run_batch: bool = True) -> tuple[dict, dict]:
    """Single-stream decode vs memory bandwidth, and `batch_streams` sessions in eval_batch.

    Rounds interleave one bandwidth read, a run of single-stream steps and a run of batched
    steps; each figure is the best round, so a burst of load elsewhere hits all three alike.
    """
    ctx = 32 if quick else 128
    rounds, chunk, b_chunk = (2, 2, 1) if quick else (4, 8, 4)
    pool = dl.create_kv_pool(m)
    prompt = sample_tokens(m, ctx + batch_streams)
    base = dl.create_session(m, pool)
    token = _argmax_rows(dl.eval(m, base, prompt[:ctx]))[0]
    sessions, cache, tokens = [], None, []
    if run_batch:
        # The batch shares the base session's context through the prefix cache, so setting up
        # eight contexts costs one prefill, not eight.
        cache = dl.create_prefix_cache()
        dl.prefix_insert(cache, pool, base, prompt[:ctx])
        tails = []
        for i in range(batch_streams):
            s = dl.create_session(m, pool)
            p = prompt[:ctx] + [prompt[ctx + i]]  # a different last token per stream
            tails.append(p[dl.prefix_attach(cache, pool, s, p):])
            sessions.append(s)
        tokens = _argmax_rows(dl.eval_batch(m, sessions, tails))
    nbytes, read = bandwidth_probe()
    read()
    t_dec, t_bw, t_b = [], [], []
    for _ in range(rounds):
        t_bw.append(read())
        t0 = time.perf_counter()
        for _ in range(chunk):
            token = _argmax_rows(dl.eval(m, base, [token]))[0]
        t_dec.append(time.perf_counter() - t0)
        if run_batch:
            t0 = time.perf_counter()
            for _ in range(b_chunk):
                tokens = _argmax_rows(dl.eval_batch(m, sessions, [[t] for t in tokens]))
            t_b.append(time.perf_counter() - t0)
    t_bw.append(read())
    del read
    weight_bytes = m.weights.matmul_bytes()
    single_tps = chunk / min(t_dec)
    bw = nbytes / min(t_bw)
    weight_bw = weight_bytes * single_tps
    figures = {
        "decode_tok_s": figure(single_tps, "tok/s", FEATURE,
                               note=f"context {ctx}, best of {rounds} runs of {chunk} tokens"),
        "decode_weight_gb_s": figure(weight_bw / 1e9, "GB/s", FEATURE,
                                     note="Weights.matmul_bytes() x decode tok/s"),
        "mem_read_gb_s": figure(bw / 1e9, "GB/s", FEATURE,
                                note=f"best GEMV over a {nbytes >> 20} MiB float32 array"),
        "decode_bw_fraction": figure(ratio(weight_bw, bw), "ratio", FEATURE, **target("decode_bw_fraction")),
    }
    details = {"context": ctx, "weight_bytes_per_token": weight_bytes,
               "bandwidth_method": f"best of {len(t_bw)} GEMVs (a @ x, one full read each) over a float32 "
                                   f"[{nbytes // (4 * 8192)}, 8192] array",
               "bandwidth_bytes": nbytes, "bandwidth_s": t_bw, "decode_chunk_s": t_dec,
               "decode_chunk_tokens": chunk}
    if run_batch:
        batch_tps = batch_streams * b_chunk / min(t_b)
        figures["batch_decode_tok_s"] = figure(
            batch_tps, "tok/s", FEATURE,
            note=f"{batch_streams} sessions in eval_batch, context ~{ctx}")
        figures["batch_speedup"] = figure(ratio(batch_tps, single_tps), "x", FEATURE,
                                          **target("batch_speedup"),
                                          note="aggregate batch tok/s / single-stream tok/s")
        details.update({"batch_streams": batch_streams, "batch_chunk_s": t_b, "batch_chunk_steps": b_chunk})
        for s in sessions:
            s.release()
        dl.prefix_release(cache, pool)
    base.release()
    return figures, details


# BLAS threads (diagnostic) ---------------------------------------------------------------
BLAS1_FIGURES = ("prefill_tok_s", "prefill_flops_fraction", "decode_tok_s", "mem_read_gb_s",
                 "decode_bw_fraction", "batch_decode_tok_s", "batch_speedup")


def blas_thread_figures(m, quick: bool) -> tuple[dict, dict]:
    """The prefill and decode sections again with ONE BLAS thread (then the engine chooses again).

    Not a target: it shows how much of a miss is BLAS threading. The engine itself picks the
    free cores before each pass (engine.cpu.blas_threads); this pins it to 1 for comparison.
    """
    chooser = engine_blas_threads()
    default = chooser.max_threads
    if default == 1:
        return {}, {"available": False, "reason": "BLAS already runs one thread: nothing to compare"}
    chooser.pinned = 1
    try:
        pf, pd = prefill_figures(m, quick)
        df, dd = decode_figures(m, quick)
    finally:
        chooser.pinned = None
    both = {**pf, **df}
    figures = {}
    for name in BLAS1_FIGURES:
        f = dict(both[name])
        f["note"] = ("diagnostic, BLAS pinned to 1 thread (the engine chooses up to " + str(default) + ")"
                     + (f"; target {f['op']} {f['target']}" if f["target"] is not None else ""))
        f["target"] = f["op"] = f["pass"] = None
        figures[f"{name}_blas1"] = f
    return figures, {"available": True, "default_threads": default, "prefill": pd, "decode": dd}


# load and RSS (child processes) ---------------------------------------------------------
def _child(path: str, prompt_tokens: int, new_tokens: int) -> dict:
    """Load the model, prefill a prompt, decode some tokens; report seconds and peak RSS."""
    base = peak_rss_mb()
    t0 = time.perf_counter()
    m = dl.load_model(path)
    load_s = time.perf_counter() - t0
    after_load = peak_rss_mb()
    pool = dl.create_kv_pool(m)
    s = dl.create_session(m, pool)
    prompt = sample_tokens(m, prompt_tokens)
    logits = dl.eval(m, s, prompt)
    for _ in range(new_tokens):
        logits = dl.eval(m, s, [int(np.argmax(logits))])
    s.release()
    return {"load_s": load_s, "from_image": m.from_image, "rss_start_mb": base,
            "rss_after_load_mb": after_load, "rss_peak_mb": peak_rss_mb(),
            "prompt_tokens": prompt_tokens, "new_tokens": new_tokens}


def _run_child(path: str, cache_dir: str, quick: bool) -> dict:
    n_prompt, n_new = (16, 2) if quick else (256, 32)
    cmd = [sys.executable, "-m", "app.bench.engine", "--child", path, str(n_prompt), str(n_new)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                         env=child_env(PREFIXLAB_CACHE_DIR=cache_dir))
    if out.returncode != 0:
        raise RuntimeError(f"bench child failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def load_figures(path: str, cache_dir: str, quick: bool) -> tuple[dict, dict]:
    """Cold load (empty weight-image cache: dequantize + write the image) then warm load (mmap
    the image), each in a fresh child that also generates, so its peak RSS is load + generate."""
    if os.path.exists(os.path.join(cache_dir, "weights")):
        shutil.rmtree(os.path.join(cache_dir, "weights"))
    cold = _run_child(path, cache_dir, quick)
    warm = _run_child(path, cache_dir, quick)
    peak_gb = max(cold["rss_peak_mb"], warm["rss_peak_mb"]) / 1000
    figures = {
        "cold_load_s": figure(cold["load_s"], "s", FEATURE,
                              note="empty PREFIXLAB_CACHE_DIR: dequantize + write the weight image "
                                   "(GGUF in the OS page cache)"),
        "warm_load_s": figure(warm["load_s"], "s", FEATURE, **target("warm_load_s"),
                              note="from the weight image"),
        "peak_rss_gb": figure(peak_gb, "GB", FEATURE, **target("peak_rss_gb"),
                              note="max peak RSS (VmHWM) of the cold and warm load+generate children"),
        "peak_rss_warm_gb": figure(warm["rss_peak_mb"] / 1000, "GB", FEATURE),
        "peak_rss_cold_gb": figure(cold["rss_peak_mb"] / 1000, "GB", FEATURE),
    }
    if cold["from_image"] or not warm["from_image"]:
        figures["warm_load_s"]["note"] += " (WARNING: cold/warm image use was not as expected)"
    return figures, {"cold": cold, "warm": warm, "units": "MB and GB are decimal (1e6, 1e9 bytes)"}


def temp_cache_dir() -> str:
    return tempfile.mkdtemp(prefix="prefixlab-bench-")


def _main() -> int:
    dl.tune_process()  # NumPy is loaded: OpenBLAS has its timeout from the parent's environment
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--child", nargs=3, metavar=("MODEL", "PROMPT_TOKENS", "NEW_TOKENS"), required=True)
    a = p.parse_args()
    path, n_prompt, n_new = a.child[0], int(a.child[1]), int(a.child[2])
    print(json.dumps(_child(path, n_prompt, n_new)))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
