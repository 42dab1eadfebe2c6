"""Scenario files: a system prompt with several prompts, or one conversation (JSON)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from engine.stream import MAX_NEW_TOKENS

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCENARIO_DIR = os.path.join(REPO_ROOT, "resources", "scenarios")


@dataclass
class Scenario:
    """One system prompt and either independent prompts or the turns of one conversation."""

    name: str
    system: str
    prompts: list[str] = field(default_factory=list)
    conversation: list[str] = field(default_factory=list)
    description: str = ""
    max_new_tokens: int = MAX_NEW_TOKENS
    path: str = ""


def load_scenario(path: str) -> Scenario:
    """Read a scenario file; ValueError names the file and the field that is wrong."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as e:
        raise ValueError(f"{path}: cannot read scenario ({e.strerror})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a scenario must be a JSON object")
    prompts, turns = data.get("prompts", []), data.get("conversation", [])
    for key, value in (("prompts", prompts), ("conversation", turns)):
        if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
            raise ValueError(f"{path}: '{key}' must be a list of strings")
    if not prompts and not turns:
        raise ValueError(f"{path}: a scenario needs 'prompts' or 'conversation'")
    system = data.get("system", "")
    if not isinstance(system, str):
        raise ValueError(f"{path}: 'system' must be a string")
    max_new = data.get("max_new_tokens", MAX_NEW_TOKENS)
    if not isinstance(max_new, int) or max_new < 1:
        raise ValueError(f"{path}: 'max_new_tokens' must be an integer >= 1")
    return Scenario(name=str(data.get("name") or os.path.basename(path)), system=system, prompts=prompts,
                    conversation=turns, description=str(data.get("description", "")),
                    max_new_tokens=max_new, path=path)


def bundled_scenarios() -> list[Scenario]:
    """The scenarios shipped in resources/scenarios, by file name."""
    return [load_scenario(os.path.join(SCENARIO_DIR, f))
            for f in sorted(os.listdir(SCENARIO_DIR)) if f.endswith(".json")]


def sample_tokens(m, n: int) -> list[int]:
    """n real-text token ids of model `m` (the eight-questions system prompt, repeated): the
    bench's and the replay's measuring prompt."""
    import engine as dl
    text = load_scenario(os.path.join(SCENARIO_DIR, "eight_questions.json")).system
    ids = dl.encode(m, text)
    return (ids * (n // len(ids) + 1))[:n]
