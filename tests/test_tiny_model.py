"""The forward pass: against a naive reference, paged vs contiguous, batched vs single, errors."""

from __future__ import annotations

import numpy as np
import pytest

import engine as dl
from engine import attention as ea
from engine import model as em
from tests.tiny_gguf import read_weights, reference_logits

PROMPT = ("<|im_start|>system\nYou are the tiny test model.<|im_end|>\n<|im_start|>user\n"
          "Tell me where the wind comes from, in a sentence or two.<|im_end|>\n")


def contiguous_logits(m, tokens, chunks=None) -> list[np.ndarray]:
    """Logits after each chunk's last token with plain contiguous K/V (no pool, no pages).

    `chunks` are the chunk lengths (one chunk by default), so a paged run fed the same
    chunks does exactly the same arithmetic and only the K/V storage differs.
    """
    cfg, w, linear = m.config, m.weights, m.backend.linear
    d, kv, H, KV, hd = cfg.d_model, cfg.kv_dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    K = np.zeros((cfg.n_layers, len(tokens), KV, hd), dtype=np.float32)   # [L, S, KV, hd]
    V = np.zeros_like(K)
    out, n_past = [], 0
    for T in chunks or [len(tokens)]:
        pos = np.arange(n_past, n_past + T)
        cos, sin = em.rope_angles(pos, hd, cfg.rope_base)
        x = np.asarray(w.token_embd[np.asarray(tokens[n_past:n_past + T])], dtype=np.float32)
        for layer in range(cfg.n_layers):
            h = em.rms_norm(x, w.attn_norm[layer], cfg.norm_eps)
            qkv = linear(h, "wqkv", layer)      # the engine's own GEMM path: this test is about paging
            q = em.apply_rope(qkv[:, :d].reshape(T, H, hd), cos, sin)
            K[layer, pos] = em.apply_rope(qkv[:, d:d + kv].reshape(T, KV, hd), cos, sin)
            V[layer, pos] = qkv[:, d + kv:].reshape(T, KV, hd)
            att = ea.attention(q, K[layer, :n_past + T], V[layer, :n_past + T], n_past)
            x = x + linear(att.astype(np.float32), "wo", layer)  # the engine keeps float32
            h = em.rms_norm(x, w.ffn_norm[layer], cfg.norm_eps)
            x = x + em.gated_ffn(h, linear, layer)
        out.append(linear(em.rms_norm(x[-1:], w.output_norm, cfg.norm_eps), "output_t")[0])
        n_past += T
    return out


@pytest.fixture(scope="module")
def prompt_ids(tiny_model) -> list[int]:
    ids = dl.encode(tiny_model, PROMPT)
    assert len(ids) > 64, "the prompt must span several pages of 16 and more than one of 64"
    return ids


@pytest.mark.parametrize("variant", ["tied", "untied"])
def test_logits_match_naive_reference(request, variant, prompt_ids):
    m = request.getfixturevalue("tiny_model" if variant == "tied" else "tiny_untied_model")
    assert (m.weights.output is m.weights.token_embd) == (variant == "tied")
    ids = prompt_ids[:40]
    ref = reference_logits(m.path, ids, read_weights(m.path))
    pool = dl.create_kv_pool(m, page_rows=16)
    s = dl.create_session(m, pool)
    got = dl.eval_batch(m, [s], [ids], all_positions=True)
    assert got.shape == (len(ids), m.config.vocab_size) and got.dtype == np.float32
    assert np.abs(ref).max() > 1.0, "degenerate reference: logits too small to compare"
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    # and token by token through the public API (decode steps over the paged pool)
    s2 = dl.create_session(m, pool)
    dl.eval(m, s2, ids[:30])
    for i in range(30, 40):
        np.testing.assert_allclose(dl.eval(m, s2, [ids[i]]), ref[i], atol=1e-4, rtol=0)


@pytest.mark.parametrize("page_rows", [1, 16, 64])
def test_paged_equals_contiguous(tiny_model, prompt_ids, page_rows):
    m, ids = tiny_model, prompt_ids
    # a ragged prefill (chunks crossing page boundaries), then decode steps
    chunks = [23, 14, 24] + [1] * (len(ids) - 61)
    want = contiguous_logits(m, ids, chunks)
    pool = dl.create_kv_pool(m, page_rows=page_rows)
    s = dl.create_session(m, pool)
    worst, start = 0.0, 0
    for n, w in zip(chunks, want, strict=True):
        got = dl.eval(m, s, ids[start:start + n])
        start += n
        # relative to the logits' scale: decode steps attend over padded pages in one batch,
        # which sums the same terms in another order than the contiguous reference
        worst = max(worst, float(np.abs(got - w).max() / np.abs(w).max()))
    assert worst <= 5e-6, f"page_rows={page_rows}: max |paged - contiguous| / max |logit| = {worst:.2e}"
    assert s.n_past == len(ids) and s.tokens == ids
    assert len(s.page_table) == -(-len(ids) // page_rows)
    assert len(set(s.page_table)) == len(s.page_table)
    dl.release_kv_pages(s)
    pool.check()
    assert pool.num_used_pages == 0


@pytest.mark.model
def test_paged_equals_contiguous_real_model(real_model):
    m = real_model
    ids = dl.encode(m, "<|im_start|>user\nWhy do caches make programs faster?<|im_end|>\n"
                       "<|im_start|>assistant\n")
    ids = ids[:17]
    chunks = [9, 5, 1, 1, 1]         # pages of 4: chunks start mid-page and cross pages
    want = contiguous_logits(m, ids, chunks)
    pool = dl.create_kv_pool(m, page_rows=4)
    s = dl.create_session(m, pool)
    start, worst = 0, 0.0
    for n, w in zip(chunks, want, strict=True):
        got = dl.eval(m, s, ids[start:start + n])
        start += n
        worst = max(worst, float(np.abs(got - w).max() / np.abs(w).max()))  # relative, as above
        assert int(got.argmax()) == int(w.argmax())
    assert worst <= 5e-6, f"max |paged - contiguous| / max |logit| = {worst:.2e}"


def test_eval_batch_ragged_equals_separate_evals(tiny_model, prompt_ids):
    m, ids = tiny_model, prompt_ids
    histories = [ids[:5], ids[:17], [], ids[3:40]]
    new = [ids[5:6], ids[17:21], ids[:7], ids[40:41]]
    pool = dl.create_kv_pool(m, page_rows=8)
    batch = [dl.create_session(m, pool) for _ in histories]
    for s, h in zip(batch, histories, strict=True):
        if h:
            dl.eval(m, s, h)
    got = dl.eval_batch(m, batch, new)
    assert got.shape == (len(batch), m.config.vocab_size)
    for i, (h, t) in enumerate(zip(histories, new, strict=True)):
        s = dl.create_session(m, dl.create_kv_pool(m, page_rows=16))
        if h:
            dl.eval(m, s, h)
        want = dl.eval(m, s, t)
        np.testing.assert_allclose(got[i], want, atol=1e-4, rtol=0)
        assert batch[i].n_past == len(h) + len(t) and batch[i].tokens == h + t
    # the rows differ from each other: the batch did not just copy one session
    assert np.abs(got[0] - got[1]).max() > 1e-2
    for s in batch:
        dl.release_kv_pages(s)
    pool.check()
    assert pool.num_used_pages == 0


@pytest.mark.parametrize("side_by_side", [True, False])
def test_decode_over_shared_cached_pages_equals_separate_evals(tiny_model, prompt_ids, side_by_side):
    # Sessions that attached the same cached pages decode together; the pages they all hold
    # are read once for all of them (a view when side by side in the pool, else a copy).
    m, ids = tiny_model, prompt_ids
    pool = dl.create_kv_pool(m, page_rows=8)
    cache = dl.create_prefix_cache()
    if not side_by_side:  # a page in between pushes the prefix's pages apart
        gap = dl.create_session(m, pool)
        dl.eval(m, gap, ids[:8])
    owner = dl.create_session(m, pool)
    for i in range(0, 32, 8):          # page by page, each sandwiched between gap pages
        dl.eval(m, owner, ids[i:i + 8])
        if not side_by_side:
            dl.eval(m, gap, ids[:8])
    dl.prefix_insert(cache, pool, owner, ids[:32])
    tails = [ids[32:35], ids[40:41], ids[50:55]]
    batch = []
    for t in tails:
        s = dl.create_session(m, pool)
        assert dl.prefix_attach(cache, pool, s, ids[:32] + t) == 32
        dl.eval(m, s, t)
        batch.append(s)
    shared = batch[0].page_table[:4]
    assert (shared == list(range(shared[0], shared[0] + 4))) == side_by_side
    nxt = [[int(t) % 100 + 1] for t in range(3)]
    got = dl.eval_batch(m, batch, nxt)
    for i, t in enumerate(tails):
        alone = dl.create_session(m, dl.create_kv_pool(m, page_rows=16))
        want = dl.eval(m, alone, ids[:32] + t + nxt[i])
        np.testing.assert_allclose(got[i], want, atol=1e-4, rtol=0)


def test_chunked_prefill_equals_one_shot(tiny_model, prompt_ids):
    m, ids = tiny_model, prompt_ids
    pool = dl.create_kv_pool(m, page_rows=16)
    one = dl.create_session(m, pool)
    want = dl.eval(m, one, ids)
    pieces = dl.create_session(m, pool)
    start = 0
    for n in (7, 9, 1, 13, 16, len(ids)):
        if start >= len(ids):
            break
        got = dl.eval(m, pieces, ids[start:start + n])
        start += n
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert pieces.n_past == one.n_past == len(ids)
    assert pieces.tokens == one.tokens == ids
    # both continue identically
    nxt = int(want.argmax())
    np.testing.assert_allclose(dl.eval(m, pieces, [nxt]), dl.eval(m, one, [nxt]), atol=1e-4, rtol=0)


def _state(s):
    return s.n_past, list(s.tokens), list(s.page_table)


def test_eval_on_released_session_is_a_clear_error(tiny_model, prompt_ids):
    m = tiny_model
    pool = dl.create_kv_pool(m)
    s = dl.create_session(m, pool)
    dl.eval(m, s, prompt_ids[:10])
    dl.release_kv_pages(s)
    used = pool.num_used_pages
    with pytest.raises(ValueError, match="released"):
        dl.eval(m, s, prompt_ids[10:12])
    with pytest.raises(ValueError, match="released"):
        dl.eval_batch(m, [s], [prompt_ids[10:12]])
    assert pool.num_used_pages == used == 0
    pool.check()


@pytest.mark.parametrize("bad", [-1, 269, 10**6])
def test_token_outside_vocabulary_is_a_clear_error(tiny_model, prompt_ids, bad):
    m = tiny_model
    assert m.config.vocab_size == 269
    pool = dl.create_kv_pool(m)
    s = dl.create_session(m, pool)
    dl.eval(m, s, prompt_ids[:10])
    before, used = _state(s), pool.num_used_pages
    with pytest.raises(ValueError, match=rf"token id {bad} is outside the vocabulary"):
        dl.eval(m, s, [prompt_ids[10], bad])
    assert _state(s) == before and pool.num_used_pages == used
    # still usable, and the failed call left no trace in its K/V
    fresh = dl.create_session(m, dl.create_kv_pool(m))
    np.testing.assert_allclose(dl.eval(m, s, prompt_ids[10:14]),
                               dl.eval(m, fresh, prompt_ids[:14]), atol=1e-4, rtol=0)


def test_empty_token_list_is_a_clear_error(tiny_model, prompt_ids):
    m = tiny_model
    pool = dl.create_kv_pool(m)
    s = dl.create_session(m, pool)
    with pytest.raises(ValueError, match="no tokens"):
        dl.eval(m, s, [])
    assert _state(s) == (0, [], [])
    dl.eval(m, s, prompt_ids[:3])
    before = _state(s)
    with pytest.raises(ValueError, match="no tokens"):
        dl.eval(m, s, [])
    assert _state(s) == before
    assert dl.eval(m, s, prompt_ids[3:5]).shape == (m.config.vocab_size,)


def test_failed_batch_changes_no_session(tiny_model, prompt_ids):
    m = tiny_model
    pool = dl.create_kv_pool(m)
    a, b = dl.create_session(m, pool), dl.create_session(m, pool)
    dl.eval(m, a, prompt_ids[:4])
    before_a, before_b, used = _state(a), _state(b), pool.num_used_pages
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dl.eval_batch(m, [a, b], [prompt_ids[4:6], [0, 999]])
    assert _state(a) == before_a and _state(b) == before_b and pool.num_used_pages == used
    with pytest.raises(ValueError, match="same session twice"):
        dl.eval_batch(m, [a, a], [[5], [6]])
    assert _state(a) == before_a
