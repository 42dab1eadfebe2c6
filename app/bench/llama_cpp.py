"""Bench section "llama_cpp", and the one owner of running llama.cpp in the bench.

Loading llama-cpp-python and timing its prefill and decode live here; the "peer" section
(`--peer llama-cpp`) reuses them in its own process, and both name llama.cpp's speed with
`speed_figures`. The section itself runs llama.cpp in a child process with the same prompt
length as the prefill section and as many threads as the engine's BLAS uses; the ratios
divide the engine's figures of this run by llama.cpp's. When the peer section already
measured llama.cpp in this run, its figures are reused rather than measured again.
A diagnostic: no targets.
"""

from __future__ import annotations

import json
import os
import sys
import time

from .common import ChildKilled, blas_threads, figure, ratio, timed_child

FEATURE = "llama.cpp"  # the table's and the JSON's "feature" of its figures
SPEED = ("llama_cpp_prefill_tok_s", "llama_cpp_decode_tok_s")
# llama-cpp-python's default build uses every instruction the CPU reports; on a Sapphire Rapids
# KVM guest its AMX matmul killed the process (SIGSEGV) on the first prefill. This build does not.
REBUILD = ("CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON' "
           "pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python")


def version() -> str | None:
    """llama-cpp-python's version when it is importable, else None."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return getattr(llama_cpp, "__version__", "?")


def load(path: str, threads: int, n_ctx: int = 1024):
    """A quiet llama.cpp model on `path` running `threads` threads (prefill and decode alike)."""
    from llama_cpp import Llama
    return Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                 n_batch=min(512, n_ctx), verbose=False)


def prefill_seconds(llm, prompt: list[int]) -> float:
    """Seconds llama.cpp takes to evaluate `prompt` from an empty context."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    return time.perf_counter() - t0


def decode_seconds(llm, prompt: list[int], n: int) -> float:
    """Seconds for n greedy tokens after the first (llama.cpp samples inside generate)."""
    llm.reset()
    t0 = 0.0
    for i, _ in enumerate(llm.generate(prompt, temp=0.0, top_k=1, reset=True)):
        if i == 0:
            t0 = time.perf_counter()
        if i == n:
            break
    return time.perf_counter() - t0


def speed_figures(prefill_tok_s: float, decode_tok_s: float, feature: str, note: str) -> dict:
    """llama.cpp's prefill and decode tok/s under their one name, whichever section measured them."""
    return {SPEED[0]: figure(prefill_tok_s, "tok/s", feature, note=note),
            SPEED[1]: figure(decode_tok_s, "tok/s", feature, note=note)}


def _child(path: str, n_prompt: int, n_new: int, threads: int) -> dict:
    """Prefill `n_prompt` tokens (best of 2), then decode `n_new` greedy tokens; seconds of each."""
    llm = load(path, threads, n_ctx=n_prompt + n_new + 8)
    text = "The lighthouse keeper counted the ships that passed the harbour at dawn. " * (n_prompt // 8 + 2)
    prompt = llm.tokenize(text.encode("utf-8"), add_bos=True)[:n_prompt]
    prefill = [prefill_seconds(llm, prompt) for _ in range(2)]
    decode = decode_seconds(llm, prompt, n_new)
    llm.close()
    return {"prefill_s": prefill, "decode_s": decode, "prompt_tokens": len(prompt), "new_tokens": n_new,
            "threads": threads, "version": version()}


def run_child(path: str, n_prompt: int, n_new: int, threads: int) -> dict:
    """`_child`'s seconds, measured in a child process: a llama.cpp that crashes takes only that
    child down, and the RuntimeError says how (and, for a crash, which build avoids it)."""
    cmd = [sys.executable, "-m", "app.bench.llama_cpp", path, str(n_prompt), str(n_new), str(threads)]
    try:
        _, stdout = timed_child(cmd)
    except RuntimeError as e:
        hint = f"; a build without AMX: {REBUILD}" if isinstance(e, ChildKilled) else ""
        raise RuntimeError(f"llama.cpp could not run {os.path.basename(path)} here: {e}{hint}") from None
    return json.loads(stdout.strip().splitlines()[-1])


def llama_cpp_figures(path: str, quick: bool, figures_so_far: dict) -> tuple[dict, dict]:
    """llama.cpp's tok/s on `path` and the engine's as a fraction of it (when those sections ran)."""
    if all(k in figures_so_far for k in SPEED):   # the peer section measured it in this run
        figures: dict = {}
        prefill, decode = (figures_so_far[k]["value"] for k in SPEED)
        d: dict = {"reused": "peer"}
    else:
        if version() is None:
            raise RuntimeError("llama-cpp-python is not installed (pip install llama-cpp-python)")
        n_prompt, n_new = (32, 4) if quick else (256, 32)
        # as many threads as the engine's BLAS runs with, so both sides get the same cores
        threads = blas_threads() or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                     else (os.cpu_count() or 1))
        d = run_child(path, n_prompt, n_new, threads)
        prefill = d["prompt_tokens"] / min(d["prefill_s"])
        decode = d["new_tokens"] / d["decode_s"]
        note = f"llama-cpp-python {d['version']}, {threads} threads, same GGUF"
        figures = speed_figures(prefill, decode, FEATURE, note=f"{d['prompt_tokens']}-token prompt; {note}")
    ours = {k: figures_so_far.get(k, {}).get("value") for k in ("prefill_tok_s", "decode_tok_s")}
    if ours["prefill_tok_s"] is not None:
        figures["prefill_vs_llama_cpp"] = figure(ratio(ours["prefill_tok_s"], prefill), "x", FEATURE,
                                                 note="engine prefill tok/s / llama.cpp's")
    if ours["decode_tok_s"] is not None:
        figures["decode_vs_llama_cpp"] = figure(ratio(ours["decode_tok_s"], decode), "x", FEATURE,
                                                note="engine decode tok/s / llama.cpp's")
    return figures, d


if __name__ == "__main__":
    p, n_prompt, n_new, threads = sys.argv[1], *(int(a) for a in sys.argv[2:5])
    print(json.dumps(_child(p, n_prompt, n_new, threads)))
