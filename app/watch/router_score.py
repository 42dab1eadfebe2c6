"""A precise prefix-cache router's view of the watched engines (docs/design.md §13, live).

For a prompt's token ids, each engine's score is the fraction of the prompt's full
blocks it holds as a leading prefix, read from its KV events (llm-d's precise
scorer); the router picks the highest score, the lowest engine index on a tie.
Blocks are compared by content (the token prefix they cache, as the cross-engine
view keys them), so engines with different hash seeds still compare.
"""

from __future__ import annotations

import hashlib

from .state import EngineState, _content_keys


def _block_size(state: EngineState) -> int | None:
    if state.block_size:
        return state.block_size
    for _, b in state.blocks():
        if b.tokens:
            return len(b.tokens)
    return None


def prompt_keys(tokens: list[int], block: int) -> list[str]:
    """The content keys of the prompt's full blocks, chained as the watcher keys cached blocks."""
    keys, up = [], "root"
    for i in range(len(tokens) // block):
        part = tuple(int(t) for t in tokens[i * block:(i + 1) * block])
        up = hashlib.blake2b(f"{up}|{part}".encode(), digest_size=8).hexdigest()
        keys.append(up)
    return keys


def router_scores(states: list[EngineState], tokens: list[int]) -> dict:
    """Per engine: blocks of the prompt it holds (leading), the prompt's blocks, the score; and the pick."""
    rows = []
    for s in states:
        block = _block_size(s)
        keys = prompt_keys(tokens, block) if block else []
        live = {k for k, _ in _content_keys(s).values()}
        matched = 0
        while matched < len(keys) and keys[matched] in live:
            matched += 1
        rows.append({"engine": s.index, "name": s.name(), "block_size": block, "matched_blocks": matched,
                     "prompt_blocks": len(keys), "score": matched / len(keys) if keys else 0.0})
    pick = max(rows, key=lambda r: (r["score"], -r["engine"]))["engine"] if rows else None
    return {"tokens": len(tokens), "engines": rows, "pick": pick}
