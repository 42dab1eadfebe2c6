"""Greedy answers of the shipped scenarios stay what they were before the engine refactor.

tests/data/greedy_scenarios.json was recorded with the scheduler as it was (issue 10). An
answer must be identical, or first differ at a float32 near-tie: where the recorded and the
new token are the model's top two and their logits are less than 0.1 apart (a different
batch shape may flip such a tie). After a difference, a conversation's later turns are not
compared: their prompts hold the earlier answer.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import engine as dl

from .greedy_scenarios import DATA_FILE, run_scenario, scenario_files

pytestmark = pytest.mark.model
NEAR_TIE = 0.1


def first_difference(want: dict, got: dict) -> int | None:
    """The first generated position where the answers part (a stop counts), or None."""
    a, b = want["generated_ids"], got["generated_ids"]
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return j
    if len(a) == len(b) and want["finish_reason"] == got["finish_reason"]:
        return None
    return min(len(a), len(b))


def top_two_gap(model, ids: list[int]) -> tuple[float, set[int]]:
    """The gap between the two largest logits after `ids`, and those two tokens."""
    pool = dl.create_kv_pool(model)
    s = dl.create_session(model, pool)
    logits = dl.eval(model, s, ids)
    dl.release_kv_pages(s)
    top = np.argsort(-logits)[:2]
    return float(logits[top[0]] - logits[top[1]]), {int(t) for t in top}


@pytest.fixture(scope="module")
def recorded() -> dict:
    with open(DATA_FILE, encoding="utf-8") as fh:
        return json.load(fh)


def tokens_at(r: dict, j: int, eos: set[int]) -> set[int]:
    """The token a run chose at position j: its generated id, or a stop token if it ended."""
    return {r["generated_ids"][j]} if j < len(r["generated_ids"]) else eos


@pytest.mark.parametrize("path", scenario_files(), ids=os.path.basename)
def test_greedy_answers_match_the_recording(real_model, recorded, path):
    want_all = recorded[os.path.basename(path)]
    got_all = run_scenario(real_model, path)
    assert len(got_all) == len(want_all)
    with open(path, encoding="utf-8") as fh:
        conversation = bool(json.load(fh).get("conversation"))
    eos = set(real_model.tokenizer.eos_ids)
    for i, (want, got) in enumerate(zip(want_all, got_all)):
        assert got["prompt_ids"] == want["prompt_ids"], f"request {i}: the prompt changed"
        j = first_difference(want, got)
        if j is None:
            assert got["text"] == want["text"]
            continue
        gap, top = top_two_gap(real_model, want["prompt_ids"] + want["generated_ids"][:j])
        assert gap < NEAR_TIE and all(tokens_at(r, j, eos) & top for r in (want, got)), (
            f"request {i} of {os.path.basename(path)} differs at token {j} where the top two "
            f"logits are {gap:.3f} apart (a near-tie is < {NEAR_TIE})")
        if conversation:
            break  # later turns carry this answer in their prompt
