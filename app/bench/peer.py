"""Bench section "peer": PrefixLab against llama.cpp (llama-cpp-python) on the same GGUF, same run.

Figures (feature "llama.cpp peer"): prefill of 256 tokens, decode of one stream, eight
streams batched (aggregate) against llama.cpp's one stream, and the W8 workload (a
shared system prompt, eight questions, up to 32 greedy tokens each) as whole processes:
`prefixlab run` with default settings against a llama.cpp process answering the questions
one after another (its automatic prompt cache reuses the shared system prompt, as a
user's loop would). Each side's reps are interleaved with the other's and the best taken,
so load from other processes hits both alike. llama.cpp runs 2 threads (n_threads=2).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import engine as dl

from ..scenario import sample_tokens
from . import llama_cpp
from .common import child_env, figure, ratio, target, timed_child
from .w8 import W8_FILE, load_w8, ours_cmd

FEATURE = "llama.cpp peer"  # the table's and the JSON's "feature" of its figures
PEER_THREADS = 2
# W8 pairs (llama.cpp's process, then ours): the best of each side estimates its time on a
# quiet machine. This host's speed swings by a quarter between runs a minute apart (the same
# in-process W8 pass 1.8-2.5 s), and three pairs read 0.67-0.81 in three full runs
W8_PAIRS = 5
# PrefixLab in this process ---------------------------------------------------------------
def _our_prefill(m, prompt: list[int]) -> float:
    pool = dl.create_kv_pool(m)
    s = dl.create_session(m, pool)
    t0 = time.perf_counter()
    dl.eval(m, s, prompt)
    dt = time.perf_counter() - t0
    dl.release_kv_pages(s)
    return dt


class _OurDecode:
    """One stream and `streams` batched streams, each over a `ctx`-token context."""

    def __init__(self, m, ctx: int, streams: int):
        self.m = m
        prompt = sample_tokens(m, ctx + streams)
        self.pool = dl.create_kv_pool(m)
        self.one = dl.create_session(m, self.pool)
        self.token = int(np.argmax(dl.eval(m, self.one, prompt[:ctx])))
        self.cache = dl.create_prefix_cache()
        dl.prefix_insert(self.cache, self.pool, self.one, prompt[:ctx])
        self.batch, tails = [], []
        for i in range(streams):
            s = dl.create_session(m, self.pool)
            p = prompt[:ctx] + [prompt[ctx + i]]
            tails.append(p[dl.prefix_attach(self.cache, self.pool, s, p):])
            self.batch.append(s)
        self.tokens = [int(t) for t in np.argmax(dl.eval_batch(m, self.batch, tails), axis=-1)]

    def single(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            self.token = int(np.argmax(dl.eval(self.m, self.one, [self.token])))
        return time.perf_counter() - t0

    def batched(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            logits = dl.eval_batch(self.m, self.batch, [[t] for t in self.tokens])
            self.tokens = [int(t) for t in np.argmax(logits, axis=-1)]
        return time.perf_counter() - t0

    def close(self) -> None:
        for s in [self.one, *self.batch]:
            dl.release_kv_pages(s)
        dl.prefix_release(self.cache, self.pool)


# W8 as whole processes -------------------------------------------------------------------
def peer_w8_child(path: str) -> dict:
    """The llama.cpp side of W8 (run in a child): load, answer the questions one by one."""
    w8 = load_w8()
    llm = llama_cpp.load(path, PEER_THREADS)
    n_gen = []
    for q in w8.prompts:
        out = llm.create_chat_completion(
            messages=[{"role": "system", "content": w8.system}, {"role": "user", "content": q}],
            max_tokens=w8.max_new_tokens, temperature=0.0, top_k=1)
        n_gen.append(int(out["usage"]["completion_tokens"]))
    return {"n_gen": n_gen}


# the section -----------------------------------------------------------------------------
def peer_figures(m, quick: bool) -> tuple[dict, dict]:
    version = llama_cpp.version()
    if version is None:
        return {}, {"available": False,
                    "reason": "llama_cpp is not importable (pip install llama-cpp-python)"}
    n_prefill, ctx, n_dec, n_batch_steps, reps = (32, 32, 2, 1, 1) if quick else (256, 128, 16, 4, 3)
    streams = 8
    prompt = sample_tokens(m, n_prefill)
    llama_cpp.run_child(m.path, 8, 1, PEER_THREADS)  # a crashing build fails the section, not the bench
    llm = llama_cpp.load(m.path, PEER_THREADS)
    ours = _OurDecode(m, ctx, streams)
    _our_prefill(m, prompt)                                   # warm-up: pages, first touch
    llama_cpp.prefill_seconds(llm, prompt)
    t = {"our_prefill": [], "peer_prefill": [], "our_single": [], "peer_single": [], "our_batch": []}
    for _ in range(reps):                                     # interleaved, best of each
        t["peer_prefill"].append(llama_cpp.prefill_seconds(llm, prompt))
        t["our_prefill"].append(_our_prefill(m, prompt))
        t["peer_single"].append(llama_cpp.decode_seconds(llm, prompt[:ctx], n_dec))
        t["our_single"].append(ours.single(n_dec))
        t["our_batch"].append(ours.batched(n_batch_steps))
    ours.close()
    del llm
    our_pf, peer_pf = n_prefill / min(t["our_prefill"]), n_prefill / min(t["peer_prefill"])
    our_dec, peer_dec = n_dec / min(t["our_single"]), n_dec / min(t["peer_single"])
    our_b = streams * n_batch_steps / min(t["our_batch"])

    w8 = load_w8()
    env = child_env()
    peer_cmd = [sys.executable, "-m", "app.bench.peer", "--w8-child", m.path]
    ours_w8 = ours_cmd(m.path, w8)
    walls: dict[str, list[float]] = {"ours": [], "peer": []}
    peer_gen = None
    if not quick:
        timed_child(ours_w8, env)                           # a warm weight image and page cache
        for _ in range(W8_PAIRS):
            wall, stdout = timed_child(peer_cmd, env)
            walls["peer"].append(wall)
            peer_gen = json.loads(stdout.strip().splitlines()[-1])["n_gen"]
            walls["ours"].append(timed_child(ours_w8, env)[0])
    figures = {
        "peer_prefill_ratio": figure(
            ratio(our_pf, peer_pf), "x", FEATURE, **target("peer_prefill_ratio"),
            note=f"{n_prefill}-token prefill: {our_pf:.0f} vs llama.cpp {peer_pf:.0f} tok/s"),
        "peer_decode_ratio": figure(
            ratio(our_dec, peer_dec), "x", FEATURE, **target("peer_decode_ratio"),
            note=f"one stream, context {ctx}: {our_dec:.1f} vs llama.cpp {peer_dec:.1f} tok/s"),
        "peer_batch8_ratio": figure(
            ratio(our_b, peer_dec), "x", FEATURE, **target("peer_batch8_ratio"),
            note=f"{streams} streams aggregate {our_b:.1f} tok/s vs llama.cpp's one stream"),
        # llama.cpp's own speed, named by its owner (the llama_cpp section then reuses it)
        **llama_cpp.speed_figures(peer_pf, peer_dec, FEATURE, note=(
            f"{n_prefill}-token prefill, decode at context {ctx}; llama-cpp-python {version}, "
            f"{PEER_THREADS} threads, same GGUF")),
    }
    if walls["ours"]:
        ours_w, peer_w = min(walls["ours"]), min(walls["peer"])
        figures["peer_llama_cpp_w8_wall_s"] = figure(peer_w, "s", FEATURE,
                                                note="llama.cpp process, questions in turn")
        figures["peer_w8_wall_ratio"] = figure(ratio(ours_w, peer_w), "x", FEATURE,
                                               **target("peer_w8_wall_ratio"),
                                               note=f"PrefixLab W8 {ours_w:.2f} s (interleaved with "
                                                    "llama.cpp's) / llama.cpp's")
    details = {"available": True, "llama_cpp": version, "threads": PEER_THREADS, "reps": reps,
               "prefill_tokens": n_prefill, "context": ctx, "decode_tokens": n_dec, "streams": streams,
               "batch_steps": n_batch_steps, "seconds": t, "w8_walls": walls, "w8_peer_n_gen": peer_gen,
               "w8": W8_FILE}
    return figures, details


def _main() -> int:
    dl.tune_process()  # NumPy is loaded: OpenBLAS has its timeout from the parent's environment
    if len(sys.argv) == 3 and sys.argv[1] == "--w8-child":
        print(json.dumps(peer_w8_child(sys.argv[2])))
        return 0
    print("usage: python -m app.bench.peer --w8-child MODEL.gguf", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main())
