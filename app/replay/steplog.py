"""The twin's step cost fitted to a server's own passes (`prefixlab serve --step-log`, written by
engine/step_log.py): `prefixlab calibrate --from-log FILE [--url URL]` (docs/twin.md, section 1).

A fit made in one process predicts `serve` short on a small machine, where the HTTP side's time
comes out of the passes (docs/twin.md, section 4); these passes ran under the server's front end.
"""

from __future__ import annotations

import time

from engine.step_log import StepLogError, read_step_log

from .stepcost import IDLE_GAP_S, PassShapes, StepShape, fit

__all__ = ["StepLogError", "fit_log", "logged_passes", "read_step_log"]


def logged_passes(path: str, start: int = 0, spans: list[tuple[int, int]] | None = None
                  ) -> list[tuple[dict, list[tuple[StepShape, float]]]]:
    """[(header, [(shape, seconds)])] of the passes at byte `start` or later (or within one of the
    byte ranges `spans`), each under the header before it (an after-prompt pass is known from the
    passes before it, read from its header on; a pass after an idle moment from when it and the
    one before it started, in a version 2 log)."""
    return [(head, [(s, t) for _, s, t in passes]) for head, passes in logged_passes_at(path, start, spans)]


def logged_passes_at(path: str, start: int = 0, spans: list[tuple[int, int]] | None = None):
    """logged_passes, each pass with the byte it starts at: [(header, [(at, shape, seconds)])]."""
    spans = spans if spans is not None else [(start, float("inf"))]
    out = []
    for head, passes in read_step_log(path):
        shapes, end, kept = PassShapes(), None, []
        for at, decode, pieces, seconds, began in passes:
            # a version 1 log stamps no start: none of its passes is known to follow an idle moment
            idle = began is not None and (end is None or began - end >= IDLE_GAP_S)
            kept.append((at, shapes.parts(decode, pieces, idle), seconds))
            end = None if began is None else began + seconds
        kept = [k for k in kept if any(a <= k[0] < b for a, b in spans)]
        if kept:
            out.append((head, kept))
    return out


def fit_log(path: str, start: int = 0, spans: list[tuple[int, int]] | None = None,
            groups: list[tuple[int, int, tuple]] | None = None):
    """The step cost fitted to every pass of the log from byte `start` on, or within the byte
    ranges `spans` (one model, padding and tiling: a log whose headers differ there is refused);
    `groups`: byte ranges of calibrate's workloads, each with its (workload, run), for the fit's
    standard errors (stepcost.fit). (cost, samples, the first header)."""
    runs = logged_passes_at(path, start, spans)
    at = [a for _, passes in runs for a, _, _ in passes]
    samples = [(s, t) for _, passes in runs for _, s, t in passes]
    runs = [(head, [(s, t) for _, s, t in passes]) for head, passes in runs]
    of = [next((key for a, b, key in groups or () if a <= x < b), None) for x in at]
    of = None if None in of else of   # a pass outside every workload: no run to draw it with
    if not samples:
        raise StepLogError(f"{path}: no passes to fit" + (f" after byte {start}" if start else "")
                           + (f" in bytes {spans}" if spans else ""))
    head = runs[0][0]
    keys = ("prompt_pad_rows", "attention_tile", "model")
    if any([h.get(k) for k in keys] != [head.get(k) for k in keys] for h, _ in runs):
        raise StepLogError(f"{path}: its passes come from servers of different models or padding; "
                           "fit one server's lines (a fresh file per server)")
    tile = head.get("attention_tile")
    about = {"machine": head.get("machine", ""), "model": head.get("model", ""),
             "fit": {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "from": f"step log {path}"}}
    try:
        cost = fit([s for s, _ in samples], [t for _, t in samples],
                   prompt_pad_rows=int(head.get("prompt_pad_rows") or 0),
                   attention_tile=tuple(tile) if tile else None, groups=of, **about)
    except ValueError as e:  # too few shapes: `calibrate --url` sends the workloads that vary them
        raise StepLogError(f"{path}: {e}") from None
    return cost, samples, head
