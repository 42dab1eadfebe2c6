"""The engine against llama.cpp on the bundled model (tests/data/smollm2-135m-instruct-q4_1.json).

llama.cpp rounds activations to 8 bits, so near-ties may legitimately differ:
argmax comparisons are weighed by llama.cpp's own top-two margin.
"""

from __future__ import annotations

import numpy as np
import pytest

import engine as dl

pytestmark = pytest.mark.model

GREEDY_TOKENS = 16


@pytest.fixture(scope="module")
def teacher_forced(real_model, reference):
    """Per run: the engine's argmax after every reference token, and logits after the prompt."""
    m = real_model
    out = []
    for run in reference["runs"]:
        ids = (run["prompt_ids"] + run["greedy_ids"])[:len(run["argmax"])]
        s = dl.create_session(m, dl.create_kv_pool(m, page_rows=16))
        logits = dl.eval_batch(m, [s], [ids], all_positions=True)       # [N, vocab]
        assert logits.shape == (len(ids), m.config.vocab_size)
        out.append({"argmax": logits.argmax(axis=1),
                    "last_prompt": logits[len(run["prompt_ids"]) - 1].copy()})
        dl.release_kv_pages(s)
    return out


def test_reference_texts_tokenize_exactly(real_model, reference):
    wrong = []
    for item in reference["texts"]:
        ids = dl.encode(real_model, item["text"])
        if ids != item["ids"]:
            wrong.append((item["text"], ids, item["ids"]))
    assert not wrong, f"{len(wrong)} texts tokenize differently from llama.cpp: {wrong[:3]}"
    for run in reference["runs"]:
        assert dl.encode(real_model, run["prompt"]) == run["prompt_ids"]
        ids = list(run["greedy_ids"])
        while ids and ids[-1] in real_model.tokenizer.eos_ids:  # the text leaves out the stop token
            ids.pop()
        assert dl.decode(real_model, ids) == run["greedy_text"]


def test_teacher_forced_argmax_matches_llama_cpp(reference, teacher_forced):
    n_all = n_all_ok = n_clear = n_clear_ok = 0
    clear_misses = []
    for r, (run, got) in enumerate(zip(reference["runs"], teacher_forced, strict=True)):
        ref = np.asarray(run["argmax"])
        margin = np.asarray(run["margin"])
        same = got["argmax"] == ref
        clear = margin > 0.5
        n_all += len(ref)
        n_all_ok += int(same.sum())
        n_clear += int(clear.sum())
        n_clear_ok += int(same[clear].sum())
        clear_misses += [(r, int(i), float(margin[i])) for i in np.flatnonzero(clear & ~same)]
    clear_rate, all_rate = n_clear_ok / n_clear, n_all_ok / n_all
    print(f"\nargmax agreement: {clear_rate:.2%} of {n_clear} positions with margin > 0.5, "
          f"{all_rate:.2%} of all {n_all}; clear misses (run, pos, margin): {clear_misses}")
    assert n_clear > 200
    assert clear_rate >= 0.99, f"clear-margin agreement {clear_rate:.2%}; misses {clear_misses}"
    assert all_rate >= 0.95, f"overall agreement {all_rate:.2%}"


def test_greedy_generation_follows_llama_cpp(real_model, reference):
    m = real_model
    pool = dl.create_kv_pool(m, page_rows=16)
    exact, report = 0, []
    for r, run in enumerate(reference["runs"]):
        s = dl.create_session(m, pool)
        logits = dl.eval(m, s, run["prompt_ids"])
        ref = run["greedy_ids"][:GREEDY_TOKENS]
        ours = []
        for i in range(len(ref)):
            ours.append(int(np.argmax(logits)))
            if ours[-1] != ref[i]:
                break
            if i + 1 < len(ref):
                logits = dl.eval(m, s, [ours[-1]])
        dl.release_kv_pages(s)
        if ours == ref:
            exact += 1
            report.append((r, "same", None))
            continue
        div = len(ours) - 1
        margin = run["margin"][len(run["prompt_ids"]) - 1 + div]
        report.append((r, f"diverges at token {div}", margin))
        # a divergence is only acceptable where llama.cpp itself was near a tie
        assert margin < 1.0, (f"run {r}: greedy diverges at token {div} where llama.cpp's "
                              f"margin is {margin} (not a near-tie)")
    print(f"\ngreedy: {exact}/{len(reference['runs'])} runs reproduce {GREEDY_TOKENS} tokens; {report}")
    assert exact >= 4, report
    pool.check()
    assert pool.num_used_pages == 0


def test_last_prompt_top8_logits_are_close(reference, teacher_forced):
    for r, (run, got) in enumerate(zip(reference["runs"], teacher_forced, strict=True)):
        ids = np.asarray(run["last_top8_ids"])
        ref = np.asarray(run["last_top8_logits"])
        ours = got["last_prompt"]
        # llama.cpp's 8-bit activations shift all logits a little; compare shapes, not offsets
        diff = (ours[ids] - ours[ids].mean()) - (ref - ref.mean())
        assert np.abs(diff).max() < 0.4, f"run {r}: top-8 logits differ by {np.round(diff, 3)}"
        assert abs(float(ours[ids].mean() - ref.mean())) < 1.5, f"run {r}: logits offset"
        if ref[0] - ref[1] > 0.5:
            assert int(np.argmax(ours)) == int(ids[0]), f"run {r}: top-1 differs"
        # the top-3 sets agree, up to ids that llama.cpp itself has within 0.5 of its 3rd logit
        ours3 = set(np.argsort(-ours)[:3].tolist())
        ref_logit = dict(zip(ids.tolist(), ref.tolist(), strict=True))
        for t in ours3 ^ set(ids[:3].tolist()):
            assert t in ref_logit, f"run {r}: our top-3 id {t} is not in llama.cpp's top 8"
            assert abs(ref_logit[t] - ref[2]) < 0.5, (
                f"run {r}: top-3 sets {sorted(ours3)} vs {sorted(ids[:3].tolist())} differ "
                f"by id {t}, which is not a near-tie in llama.cpp's logits")
