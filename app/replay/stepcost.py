"""The twin's step-cost model (docs/design.md §16): one pass's seconds from what it runs.

    seconds = c0 + c_prefill x prefill rows + c_decode x decode rows
              + c_ctx x context attended by decode rows + c_prefill_ctx x (prefill row, key) pairs

A pass's shape (`StepShape`) is read from the scheduler's `Batch` before it runs. `fit` is
least squares over timed passes, a coefficient that comes out negative dropped and the rest
fitted again (a time never shrinks with more work). A fit is kept as one small versioned JSON
file of coefficients with the machine and model it was measured on; another engine's cost is
the same file with its own numbers (fit it from that engine's per-step timings with `fit`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import numpy as np

COST_FORMAT = "prefixlab-step-cost"
COST_VERSION = 1
TERMS = ("c0", "c_prefill", "c_decode", "c_ctx", "c_prefill_ctx")


@dataclass(frozen=True)
class StepShape:
    """What one pass runs: rows to prefill, rows to decode and the context they attend."""

    prefill_rows: int = 0
    decode_rows: int = 0
    decode_context: int = 0    # sum over decode rows of the positions each attends
    prefill_context: int = 0   # sum over prefill rows of the positions each attends

    def features(self) -> list[float]:
        return [1.0, self.prefill_rows, self.decode_rows, self.decode_context, self.prefill_context]


def shape_of(batch) -> StepShape:
    """The shape of a planned `engine.stream.Batch` (read before its pass runs)."""
    dec_rows = dec_ctx = pre_rows = pre_ctx = 0
    for s, drafts in zip(batch.decode, batch.draft_lists()):
        n, k = s.session.n_past, 1 + len(drafts)
        dec_rows += k
        dec_ctx += k * n + k * (k + 1) // 2
    pieces = [(s.session.n_past, len(p)) for s, p in batch.prefill]
    pieces += [(s.session.n_past, len(s.closing)) for s in batch.closing]
    for n, k in pieces:
        pre_rows += k
        pre_ctx += k * n + k * (k + 1) // 2  # row j attends n + j + 1 positions
    return StepShape(pre_rows, dec_rows, dec_ctx, pre_ctx)


@dataclass(frozen=True)
class StepCost:
    """Fitted coefficients (seconds per unit of each term) and where they were measured."""

    c0: float
    c_prefill: float = 0.0
    c_decode: float = 0.0
    c_ctx: float = 0.0
    c_prefill_ctx: float = 0.0
    machine: str = ""
    model: str = ""
    fit: dict = field(default_factory=dict)   # steps, median and worst relative error, when

    def __post_init__(self):
        for name in TERMS:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"step cost: {name} must be a finite number >= 0, got {v!r}")
        if self.c0 + self.c_prefill + self.c_decode <= 0:
            raise ValueError("step cost: c0, c_prefill and c_decode are all 0: every pass would take no time")

    def predict(self, shape: StepShape) -> float:
        return float(np.dot(self.coefficients(), shape.features()))

    def coefficients(self) -> list[float]:
        return [getattr(self, name) for name in TERMS]

    def to_json(self) -> dict:
        return {"format": COST_FORMAT, "version": COST_VERSION, **asdict(self)}

    def save(self, path: str) -> None:
        from engine.atomic import atomic_write
        data = (json.dumps(self.to_json(), indent=1) + "\n").encode()
        atomic_write(path, lambda fh: fh.write(data))

    @classmethod
    def load(cls, path: str) -> StepCost:
        """Read a cost file; ValueError names the file and what is wrong with it."""
        try:
            with open(path, encoding="utf-8") as fh:
                obj = json.load(fh)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the step-cost file {path}: {e}") from None
        if not isinstance(obj, dict) or obj.get("format") != COST_FORMAT:
            raise ValueError(f"{path} is not a step-cost file (no \"format\": \"{COST_FORMAT}\")")
        if obj.get("version") != COST_VERSION:
            raise ValueError(f"{path}: step-cost version {obj.get('version')!r}; this PrefixLab reads "
                             f"version {COST_VERSION} (run prefixlab calibrate again)")
        if "c0" not in obj:
            raise ValueError(f"{path}: the step-cost file has no c0")
        known = {k: obj[k] for k in (*TERMS, "machine", "model", "fit") if k in obj}
        try:
            return cls(**known)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def fit(shapes: list[StepShape], seconds: list[float], **about) -> StepCost:
    """Least squares on relative error (a short pass counts as much as a long one), negative
    coefficients dropped; `about` sets machine and model.

    Weighting each pass by 1 / its measured time biases the fit low (a pass slowed by another
    process counts for less than one that ran fast), so the weights become 1 / the fitted time
    and the fit is repeated until they settle (iteratively reweighted least squares)."""
    if len(shapes) < len(TERMS):
        raise ValueError(f"fitting a step cost needs at least {len(TERMS)} timed passes, got {len(shapes)}")
    x = np.array([s.features() for s in shapes], dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    coef = _nonnegative_lstsq(x, y, 1.0 / y)
    for _ in range(REWEIGHTS):
        coef = _nonnegative_lstsq(x, y, 1.0 / np.maximum(x @ coef, y.min() * 0.01))
    rel = np.abs(x @ coef - y) / y
    about = dict(about)
    about["fit"] = {**about.get("fit", {}), "steps": len(shapes), "median_rel_error": float(np.median(rel)),
                    "p90_rel_error": float(np.percentile(rel, 90)), "max_rel_error": float(rel.max())}
    return StepCost(**dict(zip(TERMS, (float(c) for c in coef))), **about)


REWEIGHTS = 5


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least squares; the most negative term dropped and the rest fitted again until
    none is negative (a time never shrinks with more work)."""
    keep = [i for i in range(x.shape[1]) if x[:, i].any()]
    while True:
        a = x[:, keep] * w[:, None]
        scale = np.abs(a).max(axis=0)
        sol = np.linalg.lstsq(a / scale, y * w, rcond=None)[0] / scale
        if (sol >= 0).all() or len(keep) == 1:
            break
        del keep[int(np.argmin(sol))]
    coef = np.zeros(x.shape[1])
    coef[keep] = np.maximum(sol, 0.0)
    return coef
