"""Bench section "llama_cpp": llama.cpp's own prefill and decode speed on the same GGUF.

It runs llama-cpp-python (when installed) in a child process, with the same prompt length
as the prefill section and as many threads as the engine's BLAS uses; the ratios
divide the engine's figures of this run by llama.cpp's. A diagnostic: no targets.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

from .common import blas_threads, child_env, figure, ratio

ISSUE = "Architectures"


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def _child(path: str, n_prompt: int, n_new: int, threads: int) -> dict:
    """Prefill `n_prompt` tokens, then decode `n_new` greedy tokens; seconds of each (best of 2 prefills)."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=path, n_ctx=n_prompt + n_new + 8, n_batch=max(n_prompt, 8),
                          n_threads=threads, logits_all=True, verbose=False)
    text = "The lighthouse keeper counted the ships that passed the harbour at dawn. " * (n_prompt // 8 + 2)
    prompt = llm.tokenize(text.encode("utf-8"), add_bos=True)[:n_prompt]
    prefill = []
    for _ in range(2):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        prefill.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(n_new):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    decode = time.perf_counter() - t0
    llm.close()
    return {"prefill_s": prefill, "decode_s": decode, "prompt_tokens": len(prompt), "new_tokens": n_new,
            "threads": threads, "version": llama_cpp.__version__}


def llama_cpp_figures(path: str, quick: bool, figures_so_far: dict) -> tuple[dict, dict]:
    """llama.cpp's tok/s on `path` and the engine's as a fraction of it (when those sections ran)."""
    if not available():
        raise RuntimeError("llama-cpp-python is not installed (pip install llama-cpp-python)")
    n_prompt, n_new = (32, 4) if quick else (256, 32)
    # as many threads as the engine's BLAS runs with, so both sides get the same cores
    threads = blas_threads() or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                 else (os.cpu_count() or 1))
    cmd = [sys.executable, "-m", "app.bench.llama_cpp", path, str(n_prompt), str(n_new), str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=child_env())
    if out.returncode != 0:
        raise RuntimeError(f"llama.cpp child failed ({out.returncode}): {out.stderr.strip()[-1000:]}")
    d = json.loads(out.stdout.strip().splitlines()[-1])
    prefill = d["prompt_tokens"] / min(d["prefill_s"])
    decode = d["new_tokens"] / d["decode_s"]
    note = f"llama-cpp-python {d['version']}, {threads} threads, same GGUF"
    figures = {
        "llama_cpp_prefill_tok_s": figure(prefill, "tok/s", ISSUE,
                                          note=f"{d['prompt_tokens']}-token prompt; {note}"),
        "llama_cpp_decode_tok_s": figure(decode, "tok/s", ISSUE, note=note),
    }
    ours = {k: figures_so_far.get(k, {}).get("value") for k in ("prefill_tok_s", "decode_tok_s")}
    if ours["prefill_tok_s"] is not None:
        figures["prefill_vs_llama_cpp"] = figure(ratio(ours["prefill_tok_s"], prefill), "x", ISSUE,
                                                 note="engine prefill tok/s / llama.cpp's")
    if ours["decode_tok_s"] is not None:
        figures["decode_vs_llama_cpp"] = figure(ratio(ours["decode_tok_s"], decode), "x", ISSUE,
                                                note="engine decode tok/s / llama.cpp's")
    return figures, d


if __name__ == "__main__":
    p, n_prompt, n_new, threads = sys.argv[1], *(int(a) for a in sys.argv[2:5])
    print(json.dumps(_child(p, n_prompt, n_new, threads)))
