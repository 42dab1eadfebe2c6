"""Greedy answers of the shipped scenarios: run them as `prefixlab run` does, and record them.

`python -m tests.greedy_scenarios` (re)writes tests/data/greedy_scenarios.json; the test in
test_greedy_scenarios.py checks that the scheduler still gives these answers.
"""

from __future__ import annotations

import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_FILE = os.path.join(ROOT, "tests", "data", "greedy_scenarios.json")


def scenario_files() -> list[str]:
    return sorted(glob.glob(os.path.join(ROOT, "resources", "scenarios", "*.json")))


def run_scenario(model, path: str, settings=None) -> list[dict]:
    """Every request of the scenario with the scheduler's default settings, greedy:
    prompt ids, generated ids (the stop token excluded), text and finish reason."""
    from engine.loop import EngineLoop
    from engine.scheduler import FinishEvent, TokenEvent

    with open(path, encoding="utf-8") as fh:
        sc = json.load(fh)
    loop = EngineLoop(model, settings)
    sch = loop.scheduler
    out: dict[int, dict] = {}

    def on_event(ev) -> None:
        if isinstance(ev, TokenEvent):
            out[ev.request_id]["generated_ids"].append(ev.token_id)
        elif isinstance(ev, FinishEvent):
            out[ev.request_id]["text"] = ev.record.text
            out[ev.request_id]["finish_reason"] = ev.reason

    def submit(user: str, **kw) -> None:
        rid = loop.submit_now(on_event, system=sc.get("system", ""), user=user,
                              max_new_tokens=sc["max_new_tokens"], **kw)
        out[rid] = {"prompt_ids": list(sch.prompt_of(rid)), "generated_ids": [], "text": "",
                    "finish_reason": None}

    def drain() -> None:
        loop.run_until_done()

    if sc.get("conversation"):
        for turn in sc["conversation"]:
            submit(turn, conversation_id="scenario")
            drain()
    else:
        for prompt in sc["prompts"]:
            submit(prompt)
        drain()
    return [out[rid] for rid in sorted(out)]


def record() -> dict:
    import engine

    model = engine.load_model()
    return {os.path.basename(p): run_scenario(model, p) for p in scenario_files()}


if __name__ == "__main__":
    data = record()
    with open(DATA_FILE, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
    print(f"wrote {DATA_FILE}", file=sys.stderr)
