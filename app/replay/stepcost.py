"""The twin's step-cost model (docs/design.md §16): one pass's seconds from what it runs.

    seconds = c0 + c_prefill x prefill rows + c_decode x decode rows
              + c_ctx x context attended by decode rows + c_prefill_ctx x (prefill row, key) pairs

A pass's shape (`StepShape`) is read from the scheduler's `Batch` before it runs. `fit` is
least squares over timed passes: the passes of one shape (timed several times) enter as their
median, so a pass slowed by another process moves the fit little; a coefficient that comes out
negative is dropped and the rest fitted again (a time never shrinks with more work); each
coefficient comes with its standard error. A fit is kept as one small versioned JSON
file of coefficients with the machine and model it was measured on; another engine's cost is
the same file with its own numbers (fit it from that engine's per-step timings with `fit`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import numpy as np

COST_FORMAT = "prefixlab-step-cost"
COST_VERSION = 2          # 2 added `stderr`; a version 1 file reads with none
READS_VERSIONS = (1, COST_VERSION)
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
    fit: dict = field(default_factory=dict)   # steps, shapes, median and worst relative error, when
    stderr: dict = field(default_factory=dict)  # term -> standard error of its coefficient (s)

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
        if obj.get("version") not in READS_VERSIONS:
            readable = ", ".join(map(str, READS_VERSIONS))
            raise ValueError(f"{path}: step-cost version {obj.get('version')!r}; this PrefixLab reads "
                             f"versions {readable} (run prefixlab calibrate again)")
        if "c0" not in obj:
            raise ValueError(f"{path}: the step-cost file has no c0")
        known = {k: obj[k] for k in (*TERMS, "machine", "model", "fit", "stderr") if k in obj}
        if not isinstance(known.get("stderr", {}), dict):
            raise ValueError(f"{path}: \"stderr\" must be an object of term -> seconds")
        try:
            return cls(**known)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def fit(shapes: list[StepShape], seconds: list[float], **about) -> StepCost:
    """Least squares on relative error (a short pass counts as much as a long one), negative
    coefficients dropped; `about` sets machine and model.

    The passes of one shape enter once, as their median time (robust to the odd pass another
    process slowed). Weighting each by 1 / its measured time biases the fit low (a slowed pass
    counts for less than one that ran fast), so the weights become 1 / the fitted time and the
    fit is repeated until they settle (iteratively reweighted least squares). The standard
    errors are the weighted fit's: the residuals' variance times (A^T A)^-1's diagonal."""
    by_shape: dict[StepShape, list[float]] = {}
    for s, t in zip(shapes, seconds):
        by_shape.setdefault(s, []).append(t)
    if len(by_shape) < len(TERMS):
        raise ValueError(f"fitting a step cost needs passes of at least {len(TERMS)} different shapes, "
                         f"got {len(by_shape)}")
    x = np.array([s.features() for s in by_shape], dtype=np.float64)
    y = np.array([np.median(ts) for ts in by_shape.values()], dtype=np.float64)
    coef, _ = _nonnegative_lstsq(x, y, 1.0 / y)
    for _ in range(REWEIGHTS):
        w = 1.0 / np.maximum(x @ coef, y.min() * 0.01)
        coef, se = _nonnegative_lstsq(x, y, w)
    rel = np.abs(x @ coef - y) / y
    every = np.asarray(seconds, dtype=np.float64)
    rel_pass = np.abs(np.array([s.features() for s in shapes]) @ coef - every) / every
    about = dict(about)
    about["fit"] = {**about.get("fit", {}), "steps": len(shapes), "shapes": len(by_shape),
                    "median_rel_error": float(np.median(rel)), "p90_rel_error": float(np.percentile(rel, 90)),
                    "max_rel_error": float(rel.max()), "pass_median_rel_error": float(np.median(rel_pass))}
    return StepCost(**dict(zip(TERMS, (float(c) for c in coef))), **about,
                    stderr={name: float(e) for name, e in zip(TERMS, se)})


REWEIGHTS = 5


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted least squares; the most negative term dropped and the rest fitted again until
    none is negative (a time never shrinks with more work). Returns the coefficients and their
    standard errors (0 for a dropped term, and for all when the fit has no spare equations)."""
    keep = [i for i in range(x.shape[1]) if x[:, i].any()]
    while True:
        a = x[:, keep] * w[:, None]
        scale = np.abs(a).max(axis=0)
        sol = np.linalg.lstsq(a / scale, y * w, rcond=None)[0] / scale
        if (sol >= 0).all() or len(keep) == 1:
            break
        del keep[int(np.argmin(sol))]
    coef, se = np.zeros(x.shape[1]), np.zeros(x.shape[1])
    coef[keep] = np.maximum(sol, 0.0)
    spare = len(y) - len(keep)
    if spare > 0:
        resid = (y - x[:, keep] @ sol) * w
        an = a / scale
        cov = np.linalg.pinv(an.T @ an) * (resid @ resid / spare)
        se[keep] = np.sqrt(np.maximum(np.diag(cov), 0.0)) / scale
    return coef, se
