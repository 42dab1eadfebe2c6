"""The engine against llama.cpp's recorded outputs (tests/data/*.json, format in its README).

Shared by the SmolLM2 and Gemma 3 reference tests. llama.cpp rounds activations to 8 bits,
so near-ties may legitimately differ: argmax comparisons are weighed by llama.cpp's own
top-two margin.
"""

from __future__ import annotations

import json
import os

import numpy as np

import engine as dl

DATA = os.path.join(os.path.dirname(__file__), "data")
GREEDY_TOKENS = 16
CLEAR_MARGIN = 0.5


def load_reference(name: str) -> dict:
    with open(os.path.join(DATA, name), encoding="utf-8") as fh:
        return json.load(fh)


def tokenization_mismatches(m, reference: dict) -> list:
    """(text, ours, llama.cpp's) for every text and prompt that tokenizes differently, and decode misses.

    `texts[].ids` have no BOS (`encode`); `runs[].prompt_ids` are whole prompts (`encode_prompt`:
    with the BOS a model like Gemma wants).
    """
    wrong = [(t["text"], ids, t["ids"]) for t in reference["texts"]
             if (ids := dl.encode(m, t["text"])) != t["ids"]]
    for run in reference["runs"]:
        if (ids := m.tokenizer.encode_prompt(run["prompt"])) != run["prompt_ids"]:
            wrong.append((run["prompt"], ids, run["prompt_ids"]))
        ids = list(run["greedy_ids"])
        while ids and ids[-1] in m.tokenizer.eos_ids:  # the text leaves out the stop token
            ids.pop()
        if (text := dl.decode(m, ids)) != run["greedy_text"]:
            wrong.append(("decode", text, run["greedy_text"]))
    return wrong


def teacher_forced(m, reference: dict, kv_dtype: str = "float32") -> list[dict]:
    """Per run: the engine's argmax after every reference token, and the logits after the prompt
    (K/V pages stored as `kv_dtype`)."""
    out = []
    for run in reference["runs"]:
        ids = (run["prompt_ids"] + run["greedy_ids"])[:len(run["argmax"])]
        s = dl.create_session(m, dl.create_kv_pool(m, page_rows=16, kv_dtype=kv_dtype))
        logits = dl.eval_batch(m, [s], [ids], all_positions=True)       # [N, vocab]
        assert logits.shape == (len(ids), m.config.vocab_size)
        out.append({"argmax": logits.argmax(axis=1),
                    "last_prompt": logits[len(run["prompt_ids"]) - 1].copy()})
        dl.release_kv_pages(s)
    return out


def argmax_agreement(reference: dict, forced: list[dict]) -> dict:
    """Agreement with llama.cpp's argmax where its margin is clear, and overall."""
    n_all = n_all_ok = n_clear = n_clear_ok = 0
    clear_misses = []
    for r, (run, got) in enumerate(zip(reference["runs"], forced, strict=True)):
        ref = np.asarray(run["argmax"])
        margin = np.asarray(run["margin"])
        same = got["argmax"] == ref
        clear = margin > CLEAR_MARGIN
        n_all += len(ref)
        n_all_ok += int(same.sum())
        n_clear += int(clear.sum())
        n_clear_ok += int(same[clear].sum())
        clear_misses += [(r, int(i), float(margin[i])) for i in np.flatnonzero(clear & ~same)]
    out = {"clear_rate": n_clear_ok / n_clear, "all_rate": n_all_ok / n_all, "n_clear": n_clear,
           "n_all": n_all, "clear_misses": clear_misses}
    print(f"\nargmax agreement: {out['clear_rate']:.2%} of {n_clear} positions with margin > "
          f"{CLEAR_MARGIN}, {out['all_rate']:.2%} of all {n_all}; clear misses (run, pos, margin): "
          f"{clear_misses}")
    return out


def greedy_agreement(m, reference: dict, n_tokens: int = GREEDY_TOKENS) -> tuple[int, list]:
    """How many runs reproduce llama.cpp's first greedy tokens; each divergence must be a near-tie."""
    pool = dl.create_kv_pool(m, page_rows=16)
    exact, report = 0, []
    for r, run in enumerate(reference["runs"]):
        s = dl.create_session(m, pool)
        logits = dl.eval(m, s, run["prompt_ids"])
        ref = run["greedy_ids"][:n_tokens]
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
    print(f"\ngreedy: {exact}/{len(reference['runs'])} runs reproduce {n_tokens} tokens; {report}")
    pool.check()
    assert pool.num_used_pages == 0
    return exact, report


def check_top8(reference: dict, forced: list[dict], shape_tol: float, offset_tol: float) -> None:
    """The 8 largest logits after each prompt match llama.cpp's in shape, offset and top ids."""
    for r, (run, got) in enumerate(zip(reference["runs"], forced, strict=True)):
        ids = np.asarray(run["last_top8_ids"])
        ref = np.asarray(run["last_top8_logits"])
        ours = got["last_prompt"]
        # llama.cpp's 8-bit activations shift all logits a little; compare shapes, not offsets
        diff = (ours[ids] - ours[ids].mean()) - (ref - ref.mean())
        assert np.abs(diff).max() < shape_tol, f"run {r}: top-8 logits differ by {np.round(diff, 3)}"
        assert abs(float(ours[ids].mean() - ref.mean())) < offset_tol, f"run {r}: logits offset"
        if ref[0] - ref[1] > CLEAR_MARGIN:
            assert int(np.argmax(ours)) == int(ids[0]), f"run {r}: top-1 differs"
        # the top-3 sets agree, up to ids that llama.cpp itself has within 0.5 of its 3rd logit
        ours3 = set(np.argsort(-ours)[:3].tolist())
        ref_logit = dict(zip(ids.tolist(), ref.tolist(), strict=True))
        for t in ours3 ^ set(ids[:3].tolist()):
            assert t in ref_logit, f"run {r}: our top-3 id {t} is not in llama.cpp's top 8"
            assert abs(ref_logit[t] - ref[2]) < CLEAR_MARGIN, (
                f"run {r}: top-3 sets {sorted(ours3)} vs {sorted(ids[:3].tolist())} differ "
                f"by id {t}, which is not a near-tie in llama.cpp's logits")
