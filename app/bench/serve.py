"""Bench section "serve": 8 concurrent streaming clients on W8 against `prefixlab serve`,
and, when llama-cpp-python is installed, the same clients against `python -m llama_cpp.server`.

Both servers run as child processes on this machine, one after the other, with the
same model file, greedy sampling and exactly `max_new` tokens per answer (PrefixLab:
`ignore_eos`; llama-cpp-python: the end-of-turn tokens biased away). Each server
first answers one warm-up request with another system prompt, so neither starts
with W8's prefix cached.
"""

from __future__ import annotations

import importlib.util
import os
import socket

from ..serve import loadtest
from .common import child_env, figure, ratio
from .w8 import load_w8

FEATURE = "OpenAI server"  # the table's and the JSON's "feature" of its figures
TARGET_VS_LLAMA_CPP = 0.8


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _measure(cmd: list[str], base: str, system: str, prompts: list[str], max_new: int, extra: dict,
             ready_path: str, env: dict) -> dict:
    proc = loadtest.start_server(cmd, base, env=env, ready_path=ready_path)
    try:
        loadtest.run_clients(base, "Warm-up.", ["Hi"], 2, extra)
        return loadtest.run_clients(base, system, prompts, max_new, extra)
    finally:
        loadtest.stop_server(proc)


def serve_figures(model_path: str, quick: bool, eos_ids: tuple[int, ...]) -> tuple[dict, dict]:
    """The section: both servers, one after the other, on the same clients."""
    sc = load_w8()
    prompts = sc.prompts[:2] if quick else sc.prompts
    max_new = 2 if quick else sc.max_new_tokens
    # Both servers get the same number of threads: OpenBLAS's for ours, n_threads for llama.cpp.
    threads = int(os.environ.get("OPENBLAS_NUM_THREADS") or os.cpu_count() or 1)
    env = child_env(OPENBLAS_NUM_THREADS=str(threads))
    port = free_port()
    ours = _measure([loadtest.python(), "-m", "app.cli", "serve", "--model", model_path, "--port", str(port),
                     "--max-streams", str(len(prompts))],
                    f"http://127.0.0.1:{port}/v1", sc.system, prompts, max_new, {"ignore_eos": True},
                    "/health", env)
    figures = {
        "serve_w8_wall_s": figure(ours["wall_s"], "s", FEATURE,
                                  note=f"{len(prompts)} streaming clients x {max_new} tokens, first request "
                                       "to last token, prefixlab serve"),
        "serve_w8_hit_rate": figure(ours["hit_rate"], "ratio", FEATURE,
                                    note="cached / prompt tokens (usage)"),
    }
    details = {"scenario": sc.path, "clients": len(prompts), "max_new": max_new, "threads": threads,
               "prefixlab": ours}
    if importlib.util.find_spec("llama_cpp") is None:
        details["llama_cpp"] = {"available": False, "reason": "llama_cpp is not importable"}
        return figures, details
    port = free_port()
    bias = {"logit_bias": {str(t): -100 for t in eos_ids}}
    cmd = [loadtest.python(), "-m", "llama_cpp.server", "--model", model_path, "--host", "127.0.0.1",
           "--port", str(port), "--n_ctx", "2048", "--n_threads", str(threads),
           # its default lets each new request cut off the one streaming: queue them instead
           "--interrupt_requests", "False"]
    try:
        theirs = _measure(cmd,
                          f"http://127.0.0.1:{port}/v1", sc.system, prompts, max_new, bias, "/v1/models", env)
    except RuntimeError as e:  # ours is measured: keep it, and say why the comparison is missing
        last = str(e).strip().splitlines()[-1]
        why = f"python -m llama_cpp.server did not start ({last}); pip install 'llama-cpp-python[server]'"
        details["llama_cpp"] = {"available": False, "reason": why}
        return figures, details
    details["llama_cpp"] = theirs
    figures["serve_w8_wall_llama_cpp_s"] = figure(theirs["wall_s"], "s", FEATURE,
                                                  note="the same clients against python -m llama_cpp.server")
    figures["serve_w8_wall_ratio"] = figure(ratio(ours["wall_s"], theirs["wall_s"]), "ratio", FEATURE,
                                            TARGET_VS_LLAMA_CPP, "<=",
                                            note="prefixlab serve wall / llama-cpp-python server wall")
    return figures, details
