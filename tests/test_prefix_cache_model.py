"""The prefix cache on the real bundled model: a hit computes exactly what a miss does.

Also the facts "The Prefix Cache by Hand" teaches, checked on SmolLM2-135M, and the
example script itself.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import engine as dl

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parent.parent
ROWS = 16
SYSTEM = (
    "You are Hank, the assistant of Hank's Hardware, a family-run hardware store. "
    "Answer questions about tools, paint, plumbing, fasteners and garden supplies "
    "briefly and kindly. If you do not know whether an item is in stock, say so and "
    "suggest asking at the front counter."
)
OTHER_SYSTEM = "You are a pirate. Answer every question in pirate speak, briefly."
Q1 = "What glue should I use to fix a wobbly wooden chair?"
Q2 = "Which paint is best for a bathroom ceiling?"


@pytest.fixture(scope="module")
def m(real_model):
    """The bundled model (conftest's session fixture)."""
    return real_model


def chat(m, system: str, question: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return dl.encode(m, m.tokenizer.render_chat(messages, add_generation_prompt=True))


def greedy(m, s, logits, n: int) -> list[int]:
    out = []
    while True:
        out.append(int(np.argmax(logits)))
        if len(out) == n:
            return out
        logits = dl.eval(m, s, [out[-1]])


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_a_hit_gives_the_same_logits_and_continuation_as_a_miss(m, kv_dtype):
    pool = dl.create_kv_pool(m, page_rows=ROWS, kv_dtype=kv_dtype)
    cache = dl.create_prefix_cache()
    p1, p2 = chat(m, SYSTEM, Q1), chat(m, SYSTEM, Q2)
    a = dl.create_session(m, pool)
    dl.eval(m, a, p1)
    assert dl.prefix_insert(cache, pool, a, p1, "system") == len(p1) // ROWS
    dl.release_kv_pages(a)

    miss = dl.create_session(m, pool)
    logits_miss = dl.eval(m, miss, p2)                    # every token computed
    hit = dl.create_session(m, pool)
    matched = dl.prefix_attach(cache, pool, hit, p2)
    assert matched >= 3 * ROWS                            # the system prompt is cached
    logits_hit = dl.eval(m, hit, p2[matched:])            # only the tail computed
    assert logits_hit.shape == logits_miss.shape == (m.config.vocab_size,)
    # Bit for bit, float16 pages too: the hit's 19-row tail is computed as the same rows of the
    # miss's 83-row pass (one GEMM kernel for every prompt row, docs/perf-notes.md), so the
    # K/V the miss stores rounds to the same float16 values the hit reads from the cache.
    assert np.array_equal(logits_hit, logits_miss), float(np.max(np.abs(logits_hit - logits_miss)))
    assert_same_kv(pool, hit, miss, len(p2))    # the cached pages and the tail's
    assert greedy(m, hit, logits_hit, 32) == greedy(m, miss, logits_miss, 32)

    for s in (miss, hit):
        dl.release_kv_pages(s)
    dl.prefix_release(cache, pool)
    pool.check()
    assert pool.num_used_pages == 0


def assert_same_kv(pool, a, b, n: int) -> None:
    """Sessions a and b hold the same K/V, bit for bit, at positions 0..n-1 (every layer)."""
    for i in range(-(-n // ROWS)):
        rows = slice(0, min(ROWS, n - i * ROWS))
        for kv in (pool.k, pool.v):
            got, want = kv[:, a.page_table[i], rows], kv[:, b.page_table[i], rows]
            assert np.array_equal(got, want), f"page {i}: differs by {float(np.max(np.abs(got - want))):.3g}"


def hit_and_miss(m, kv_dtype: str, cached: list[int], prompt: list[int]):
    """A pool and cache holding `cached`'s full pages, a miss that computed all of `prompt` and a
    hit that attached its cached pages: (pool, cache, miss, its logits, hit, matched)."""
    pool = dl.create_kv_pool(m, page_rows=ROWS, kv_dtype=kv_dtype)
    cache = dl.create_prefix_cache()
    a = dl.create_session(m, pool)
    dl.eval(m, a, cached)
    dl.prefix_insert(cache, pool, a, cached, "system")
    dl.release_kv_pages(a)
    miss = dl.create_session(m, pool)
    logits_miss = dl.eval(m, miss, prompt)
    hit = dl.create_session(m, pool)
    matched = dl.prefix_attach(cache, pool, hit, prompt)
    return pool, cache, miss, logits_miss, hit, matched


def release_all(pool, cache, sessions) -> None:
    for s in sessions:
        dl.release_kv_pages(s)
    dl.prefix_release(cache, pool)
    pool.check()
    assert pool.num_used_pages == 0


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_a_one_token_tail_after_an_exact_repeat_equals_the_miss(m, kv_dtype):
    # The prompt repeats a cached one up to one token past its last full page: the hit
    # evaluates that one token alone, a pass of one row (a GEMV and a lone query's attention,
    # were it decode), the miss the same row inside its 81-row pass.
    p1 = chat(m, SYSTEM, Q1)
    p2 = p1[:len(p1) // ROWS * ROWS + 1] if len(p1) % ROWS else p1[:len(p1) - ROWS + 1]
    pool, cache, miss, logits_miss, hit, matched = hit_and_miss(m, kv_dtype, p1, p2)
    assert len(p2) - matched == 1
    logits_hit = dl.eval(m, hit, p2[matched:], prompt=True)
    assert np.array_equal(logits_hit, logits_miss), float(np.max(np.abs(logits_hit - logits_miss)))
    assert_same_kv(pool, hit, miss, len(p2))
    release_all(pool, cache, [hit, miss])


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_a_tail_shorter_than_the_padding_equals_the_miss(m, kv_dtype):
    # Up to 5 rows: fewer than the rows a prompt pass is padded to (BLAS's small-matrix kernel
    # below them; this CPU's count, probed at load) and fewer than a query tile of the prompt's
    # attention.
    tail = min(5, m.backend.exact_rows - 1)
    if tail < 2:
        pytest.skip(f"this CPU pads a prompt pass to {m.backend.exact_rows} rows: no tail of 2 rows or "
                    "more is shorter (the one-token tail's test covers the padding)")
    p1 = chat(m, SYSTEM, Q1)
    base = (len(p1) - 1) // ROWS * ROWS
    p2 = p1[:base] + dl.encode(m, Q2)[:tail]
    pool, cache, miss, logits_miss, hit, matched = hit_and_miss(m, kv_dtype, p1, p2)
    assert matched == base and 1 < len(p2) - matched < m.backend.exact_rows
    logits_hit = dl.eval(m, hit, p2[matched:])
    assert np.array_equal(logits_hit, logits_miss), float(np.max(np.abs(logits_hit - logits_miss)))
    assert_same_kv(pool, hit, miss, len(p2))
    release_all(pool, cache, [hit, miss])


@pytest.mark.parametrize("layout", ["measured", "one row as a GEMV", "plain"])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_a_tail_beside_decoding_streams_equals_the_miss(m, kv_dtype, layout, monkeypatch):
    # A serve step: the hit's 19-row tail shares one pass with two streams' decode rows (21
    # rows, which decode sends 8 at a time), as the scheduler's chunked prefill batches them.
    # The layout this machine measured fastest (with the way it reads one row), that layout
    # reading one row as a GEMV (as a decode pass may), and the plain layout: the miss's output
    # head has one row, the hit's three (CpuBackend.head).
    if layout == "plain":
        monkeypatch.setattr(m.backend, "layout", "plain")
    elif layout != "measured":
        monkeypatch.setattr(m.backend, "one_row", "gemv")
    p1, p2 = chat(m, SYSTEM, Q1), chat(m, SYSTEM, Q2)
    pool, cache, miss, logits_miss, hit, matched = hit_and_miss(m, kv_dtype, p1, p2)
    others = [dl.create_session(m, pool) for _ in range(2)]
    firsts = [int(np.argmax(dl.eval(m, s, chat(m, OTHER_SYSTEM, q)))) for s, q in zip(others, (Q1, Q2))]
    # the default marks the sessions giving more than one token as prompts, as Batch.prompts does here
    logits = dl.eval_batch(m, others + [hit], [[t] for t in firsts] + [p2[matched:]])
    assert np.array_equal(logits[2], logits_miss), float(np.max(np.abs(logits[2] - logits_miss)))
    assert_same_kv(pool, hit, miss, len(p2))
    release_all(pool, cache, [hit, miss, *others])


LONG_Q2 = "Please tell me, in as much detail as you can manage, " * 6 + Q2


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_a_hit_whose_prefix_came_from_a_pass_of_another_length_equals_the_miss_exactly(m, kv_dtype):
    # The cached system prompt is computed in Q1's pass (87 rows), the miss computes it in its
    # own (161 rows): a row's softmax sum once depended on the masked keys after it, so the
    # cached K/V and the logits differed (float32 4e-5, float16 2.5e-3). The tail (97 rows) is
    # long enough that BLAS takes the same GEMM kernel as the miss (docs/perf-notes.md).
    pool = dl.create_kv_pool(m, page_rows=ROWS, kv_dtype=kv_dtype)
    cache = dl.create_prefix_cache()
    p1, p2 = chat(m, SYSTEM, Q1), chat(m, SYSTEM, LONG_Q2)
    assert len(p2) - len(p1) > 64
    a = dl.create_session(m, pool)
    dl.eval(m, a, p1)
    dl.prefix_insert(cache, pool, a, p1, "system")
    dl.release_kv_pages(a)
    miss = dl.create_session(m, pool)
    logits_miss = dl.eval(m, miss, p2)
    hit = dl.create_session(m, pool)
    matched = dl.prefix_attach(cache, pool, hit, p2)
    assert matched >= 3 * ROWS and len(p2) - matched > 64
    logits_hit = dl.eval(m, hit, p2[matched:])
    for i, page in enumerate(hit.page_table[:matched // ROWS]):
        assert np.array_equal(pool.k[:, page], pool.k[:, miss.page_table[i]])
        assert np.array_equal(pool.v[:, page], pool.v[:, miss.page_table[i]])
    assert np.array_equal(logits_hit, logits_miss), float(np.max(np.abs(logits_hit - logits_miss)))
    for s in (miss, hit):
        dl.release_kv_pages(s)
    dl.prefix_release(cache, pool)
    assert pool.num_used_pages == 0


def test_the_tutorial_facts(m):
    pool = dl.create_kv_pool(m, page_rows=ROWS)
    cache = dl.create_prefix_cache()
    p1, p2 = chat(m, SYSTEM, Q1), chat(m, SYSTEM, Q2)

    # A prefills, answers a little, donates prompt + answer, releases.
    a = dl.create_session(m, pool)
    answer = greedy(m, a, dl.eval(m, a, p1), 4)           # the last answer token is not evaluated
    assert a.n_past == len(p1) + 3
    added = dl.prefix_insert(cache, pool, a, p1 + answer, "hardware store")
    assert added == (len(p1) + 3) // ROWS
    [chain] = dl.prefix_chain_list(cache)
    assert (chain.n_tokens, chain.pages_live, chain.hits) == (added * ROWS, added, 0)
    assert dl.prefix_held_pages(cache) == sorted(a.page_table[:added])
    assert dl.prefix_held_groups(cache) == added
    held = dl.prefix_held_pages(cache)
    dl.release_kv_pages(a)
    assert pool.num_used_pages == added and dl.prefix_held_pages(cache) == held

    # B attaches: whole pages only, never the prompt's last token, one hit on A's chain.
    b = dl.create_session(m, pool)
    probe = dl.prefix_probe(cache, p2)
    matched = dl.prefix_attach(cache, pool, b, p2)
    shared = common_prefix(p1 + answer[:3], p2)
    assert matched % ROWS == 0 and 0 < matched <= len(p2) - 1
    assert matched == min(shared, len(p2) - 1, added * ROWS) // ROWS * ROWS
    assert (probe.matched_tokens, probe.stop_reason, probe.first_diff_index) == \
        (matched, "miss", shared)
    assert b.page_table == held[:matched // ROWS] and b.tokens == p2[:matched]
    assert [c.hits for c in dl.prefix_chain_list(cache)] == [1]
    assert (cache.counters.hits, cache.counters.tokens_saved) == (1, matched)
    dl.eval(m, b, p2[matched:])

    # Re-inserting a prefix the cache holds adds no page and no chain.
    c = dl.create_session(m, pool)
    n = dl.prefix_attach(cache, pool, c, p1)
    dl.eval(m, c, p1[n:])
    assert dl.prefix_insert(cache, pool, c, p1, "again") == 0
    assert len(dl.prefix_chain_list(cache)) == 1

    # A prompt of exactly k pages matches at most k - 1: the model needs one token to run.
    k = len(p1) // ROWS
    d = dl.create_session(m, pool)
    assert dl.prefix_probe(cache, p1[:k * ROWS]).stop_reason == "cap"
    assert dl.prefix_attach(cache, pool, d, p1[:k * ROWS]) == (k - 1) * ROWS

    # Another system prompt shares nothing the cache can use.
    p3 = chat(m, OTHER_SYSTEM, Q1)
    e = dl.create_session(m, pool)
    assert dl.prefix_attach(cache, pool, e, p3) == 0
    probe = dl.prefix_probe(cache, p3)
    assert (probe.stop_reason, probe.first_diff_index) == ("miss", common_prefix(p1, p3))

    for s in (b, c, d, e):
        dl.release_kv_pages(s)
    assert pool.num_used_pages == dl.prefix_held_groups(cache)
    dl.prefix_release(cache, pool)
    pool.check()
    assert pool.num_used_pages == 0


def test_the_example_script_runs_and_ends_with_an_empty_pool(m):
    # `m` first: the module's load leaves a weight image the script's own load reuses.
    script = ROOT / "examples" / "prefix_cache_by_hand.py"
    r = subprocess.run([sys.executable, str(script), "--answer-tokens", "4"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    cached = [line for line in lines if line.startswith("cached ")]
    assert len(cached) == 1 and "TTFT A" in cached[0] and "ms" in cached[0]
    n, total = (int(w) for w in cached[0].split()[1:4:2])
    assert 0 < n < total and n % 16 == 0
    assert any(line.startswith("chain 1:") and "1 hits" in line for line in lines)
    assert any(line.startswith("held pages:") for line in lines)
    assert lines[-1].startswith("released ") and "pool: 0 pages in use" in lines[-1]
