"""Speculative decoding from the prompt: n-gram drafts (prompt lookup), verified in one pass.

As vLLM's `ngram` proposer and llama.cpp's lookup decoding: the last few tokens of a
stream are looked up earlier in its own prompt and answer, and the tokens that followed
that occurrence are the draft. One forward pass evaluates the stream's last token plus
the k drafted tokens; the stream keeps the drafts its own sampler agrees with, plus the
sampler's token at the first disagreement, so one pass yields 1 to k+1 tokens.

The draft is a fixed guess (a point mass), so sampling every position from the model and
keeping drafts while the sample equals them is exact speculative sampling: the output has
the distribution of plain decoding, and for greedy streams it is plain greedy's output
(up to float32 near-ties, since a different batch shape sums in another order).
"""

from __future__ import annotations

import numpy as np

from .sampler import Sampler

MAX_NGRAM = 3    # longest suffix looked up
MIN_NGRAM = 1    # shortest suffix looked up
# Decode rows per pass up to which drafts ride almost free: the 64-column-block GEMMs cost,
# per pass, 0.75-1.0x one row's GEMV for 2-6 rows, 1.1x for 8, 1.3x for 10, 1.9x for 12 (measured).
SPEC_ROWS = 8


def plan_drafts(decode: list, k: int, context_length: int) -> list[list[int]]:
    """Prompt-lookup drafts per decoding stream: within its reserved positions, its token
    budget and the context, and SPEC_ROWS decode rows in all."""
    budget = max(0, SPEC_ROWS - len(decode))
    drafts = []
    for s in decode:
        n_past = s.session.n_past
        room = min(k, budget, s.max_new_tokens - s.record.n_gen - 1, s.positions - n_past - 1,
                   context_length - n_past - 1)
        d = propose(s.prompt + s.generated, room) if room > 0 else []
        budget -= len(d)
        drafts.append(d)
    return drafts


def propose(history: list[int], k: int, max_n: int = MAX_NGRAM, min_n: int = MIN_NGRAM) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of history's last n tokens.

    Tries n = max_n down to min_n; an empty list when nothing matches.
    """
    if k <= 0:
        return []
    arr = np.asarray(history, dtype=np.int64)
    for n in range(min(max_n, len(arr) - 1), min_n - 1, -1):
        tail = arr[-n:]
        # windows [i, i + n) that end before the tail itself starts
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)   # [len-n, n]
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n                                      # the latest occurrence
            return [int(t) for t in arr[start:start + k]]
    return []


def verify(sampler: Sampler, history: list[int], drafts: list[int], logits: np.ndarray) -> list[int]:
    """Tokens the stream keeps: drafts its sampler agrees with, then the sampler's own token.

    `logits` [len(drafts) + 1, vocab]: after the stream's last token, then after each draft.
    """
    kept: list[int] = []
    for i in range(len(drafts) + 1):
        token = sampler.sample(logits[i], history + kept)
        kept.append(token)
        if i == len(drafts) or token != drafts[i]:
            break
    return kept
