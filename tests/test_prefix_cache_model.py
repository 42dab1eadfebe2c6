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


def assert_close_to_scale(got: np.ndarray, want: np.ndarray, rel: float = 1e-4) -> None:
    """Equal up to float32 rounding: the largest difference is tiny against the largest value.

    The same math summed in another BLAS blocking order differs by a few ulps of the
    largest terms (seen: 1.2e-5 at values near 10), so the bound scales with the data.
    """
    scale = float(np.max(np.abs(want)))
    diff = float(np.max(np.abs(got - want)))
    assert diff <= rel * scale, f"differ by {diff:.3g}, more than {rel:g} of the scale {scale:.3g}"


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
    # float16 pages keep 11 bits: the miss's own K/V, a few float32 ulps off the cached ones
    # (another pass shape sums in another order), can round to the neighbouring float16 value,
    # so hit and miss agree to float16's precision (2^-11 = 4.9e-4), not float32's (seen: 1.7e-4)
    rel = 1e-4 if kv_dtype == "float32" else 1e-3
    assert_close_to_scale(logits_hit, logits_miss, rel)
    # The cached K/V is the one the miss computed itself.
    for i, page in enumerate(hit.page_table[:matched // ROWS]):
        assert_close_to_scale(pool.k[:, page], pool.k[:, miss.page_table[i]], rel)
        assert_close_to_scale(pool.v[:, page], pool.v[:, miss.page_table[i]], rel)
    assert greedy(m, hit, logits_hit, 32) == greedy(m, miss, logits_miss, 32)

    for s in (miss, hit):
        dl.release_kv_pages(s)
    dl.prefix_release(cache, pool)
    pool.check()
    assert pool.num_used_pages == 0


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
