"""The twin's step-cost model (docs/design.md §16): one pass's seconds from what it runs.

    seconds = c0 + c_prompt x [the pass holds prompt rows] + c_prefill x prompt rows (padded)
              + c_decode x decode rows + c_ctx x positions the decode rows attend
              + c_prefill_ctx x (prompt row, key) pairs computed
              + c_after_prompt x [a decode-only pass among the first AFTER_PROMPT_PASSES after a prompt pass]
              + c_hit_after_idle x [a prompt pass right after an idle moment that reads cached pages]

Each term is a cost the engine pays (docs/twin.md, section 1): a pass that holds prompt rows runs
every matmul as one GEMM on BLAS's threads, which packs every weight once whatever its rows
(`c_prompt`), padded to `prompt_pad_rows` rows (CpuBackend.exact_rows); its prompt rows attend in
tiles of `attention_tile` (queries, keys), every tile computed whole (attention.tiled_attention);
and BLAS's threads spin on after a prompt pass, on the core the next decode passes share their
matmuls on (`c_after_prompt`). A prompt pass on positions already in the pages (a hit's) right
after the engine idled ran slower than back to back on the 2-core EPYC, in the calibrations and
the bench's trace alike (`c_hit_after_idle`; why is not known yet: docs/twin.md, section 4). A
cost without the padding and tiles (another engine's; a file of version 1 or 2) counts prompt
rows as they are and the pairs a causal mask leaves.

A pass's shape (`StepShape`) is read from the scheduler's `Batch` before it runs (`PassShapes`).
`fit` is least squares over timed passes: the passes of one shape (timed several times) enter as
their median, so a pass slowed by another process moves the fit little; a coefficient that comes
out negative is dropped and the rest fitted again (a time never shrinks with more work); each
coefficient comes with its standard error, and the fit with their covariance (from a run's repeats
of each workload when the caller names them: the host's speed moves between them; `fit`). The
spread of the passes about the fit is kept too,
as the seconds each pass ran over the fit's time for its shape, for passes that hold prompt rows
(`extra_prompt_s`) apart from the rest (`extra_s`): the twin adds to each pass's time an extra
drawn from its kind's, since a queue's waits grow with the spread of its service times, not only
their median, and a prompt pass (a GEMM on every core's BLAS thread, as slow as its slowest core)
varies more than a decode pass (docs/twin.md, section 4). Seconds, not a factor: in a slow spell
of the host a small prompt pass ran 1.5-1.85 times its median and a large one 1.13-1.2 times,
about the same 0.1-0.15 s over it, so a factor pooled over every size gave the small passes that
start a burst too short a tail (a cost written by hand, or fitted before version 6, may still
give factors: `spread`, `spread_prompt`). Over the fit, not each shape's median: the fit weighs
relative error, so it sits under some shapes' medians, and the twin adds the extras to the fit's
time. A slow pass is seldom alone (a host slows a core for seconds), so the fit also keeps how
much a pass's extra follows the one before it (`rho`, the lag-1 correlation of their normal
scores), and the twin draws the extras of one run in that chain (`PassTimes`). A fit is
kept as one small versioned JSON file with the machine and model it was measured on; another
engine's cost is the same file with its own numbers (fit it from that engine's per-step timings
with `fit`).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field
from statistics import NormalDist

import numpy as np

COST_FORMAT = "prefixlab-step-cost"
COST_VERSION = 9          # 2 added `stderr`; 3 the prompt-pass terms, padding, tiles and `spread`;
#                           4 `spread_prompt` (in 3 `spread` held every pass's); 5 `rho` (in 1-4 0);
#                           6 `extra_s` and `extra_prompt_s`, fitted in place of the two spreads;
#                           7 `c_hit_after_idle` (in 1-6 0); 8 `covariance`, and `stderr` from the
#                           run's repeats resampled when the fit knows them (in 2-7 the residuals');
#                           9 the rounds' levels in them too (`fit.round_levels`; in 8 each
#                           workload's runs drawn alone, the host's moment shared by a round unseen)
READS_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, COST_VERSION)
TERMS = ("c0", "c_prompt", "c_prefill", "c_decode", "c_ctx", "c_prefill_ctx", "c_after_prompt",
         "c_hit_after_idle")
# Decode-only passes after a prompt pass that find BLAS's threads still spinning: OpenBLAS's
# threads spin about 2^28 cycles (~0.1 s) after their last GEMM, and the two decode passes in that
# time ran 15-25 ms slower than later ones on the 2-core EPYC (docs/twin.md, section 1).
AFTER_PROMPT_PASSES = 2
# A pass that starts this long after the one before it ended follows an idle moment: a server's
# passes ran back to back (under 2 ms apart) or after an idle one (over 0.5 s) in the bench's runs.
IDLE_GAP_S = 0.1
SPREAD_POINTS = 20        # quantiles of the per-pass spread a fit keeps


@dataclass(frozen=True)
class StepShape:
    """What one pass runs: rows to prefill, rows to decode and the context they attend."""

    prefill_rows: int = 0
    decode_rows: int = 0
    decode_context: int = 0    # sum over decode rows of the positions each attends
    prefill_context: int = 0   # sum over prefill rows of the positions each attends
    pieces: tuple[tuple[int, int], ...] = ()   # (positions before it, rows) of each prompt piece
    after_prompt: bool = False  # a decode-only pass among the first AFTER_PROMPT_PASSES after a prompt pass
    hit_after_idle: bool = False  # a prompt pass right after an idle moment, a piece of it on cached pages


def shape_from_parts(decode, pieces, after_prompt: bool = False, after_idle: bool = False) -> StepShape:
    """The shape of a pass of these decoding streams and prompt pieces ((positions before, rows));
    `after_idle`: the engine had nothing to run just before it (IDLE_GAP_S)."""
    dec_rows = dec_ctx = pre_rows = pre_ctx = 0
    for n, k in decode:
        dec_rows += k
        dec_ctx += k * n + k * (k + 1) // 2
    for n, k in pieces:
        pre_rows += k
        pre_ctx += k * n + k * (k + 1) // 2  # row j attends n + j + 1 positions
    # a piece after positions already there right after an idle moment: a hit's first piece (a
    # prompt's later chunk runs straight after its first)
    hit_after_idle = after_idle and any(n > 0 for n, _ in pieces)
    return StepShape(pre_rows, dec_rows, dec_ctx, pre_ctx, tuple((int(n), int(k)) for n, k in pieces),
                     after_prompt and not pre_rows, hit_after_idle)


def shape_of(batch, after_prompt: bool = False, after_idle: bool = False) -> StepShape:
    """The shape of a planned `engine.stream.Batch` (read before its pass runs)."""
    return shape_from_parts(*batch.parts(), after_prompt, after_idle)


class PassShapes:
    """Reads the shapes of one scheduler's passes in order (a pass's cost depends on the one
    before it: `after_prompt`; whether the engine idled before it, the caller says)."""

    def __init__(self):
        self.since_prompt = AFTER_PROMPT_PASSES   # no prompt pass yet

    def __call__(self, batch, after_idle: bool = False) -> StepShape:
        return self.parts(*batch.parts(), after_idle)

    def parts(self, decode, pieces, after_idle: bool = False) -> StepShape:
        """The next pass's shape from its streams and pieces (a logged pass's, in order)."""
        shape = shape_from_parts(decode, pieces, self.since_prompt < AFTER_PROMPT_PASSES, after_idle)
        self.since_prompt = 0 if shape.prefill_rows else self.since_prompt + 1
        return shape


def prompt_shape(n_past: int, rows: int) -> StepShape:
    """A pass of one prompt piece of `rows` rows after `n_past` positions, and nothing else."""
    return StepShape(prefill_rows=rows, prefill_context=rows * n_past + rows * (rows + 1) // 2,
                     pieces=((n_past, rows),))


def features(s: StepShape, pad_rows: int = 0, tile: tuple[int, int] | None = None) -> list[float]:
    """The terms' multipliers, in TERMS' order, for an engine that pads a prompt pass to
    `pad_rows` rows and computes prompt attention in whole `tile`s (None: the causal pairs)."""
    prompt = s.prefill_rows > 0
    rows = max(s.prefill_rows, pad_rows - s.decode_rows) if prompt else 0
    pairs = s.prefill_context
    if tile is not None and s.pieces:
        q, k = tile
        pairs = sum(-(-r // q) * q * (-(-(n + r) // k) * k) for n, r in s.pieces)
    return [1.0, float(prompt), rows, s.decode_rows, s.decode_context, pairs, float(s.after_prompt),
            float(s.hit_after_idle)]


@dataclass(frozen=True)
class StepCost:
    """Fitted coefficients (seconds per unit of each term) and where they were measured."""

    c0: float
    c_prefill: float = 0.0
    c_decode: float = 0.0
    c_ctx: float = 0.0
    c_prefill_ctx: float = 0.0
    c_prompt: float = 0.0
    c_after_prompt: float = 0.0
    c_hit_after_idle: float = 0.0
    prompt_pad_rows: int = 0                  # a prompt pass computes at least this many rows
    attention_tile: tuple[int, int] | None = None  # prompt attention's (queries, keys) per tile
    extra_s: tuple[float, ...] = ()           # quantiles of a pass's seconds over the fit's
    extra_prompt_s: tuple[float, ...] = ()    # the same for passes holding prompt rows (else `extra_s`)
    spread: tuple[float, ...] = ()            # or factors: quantiles of a pass's time / its shape's median
    spread_prompt: tuple[float, ...] = ()     # the same for passes holding prompt rows (else `spread`)
    rho: float = 0.0                          # lag-1 correlation of consecutive passes' factors
    machine: str = ""
    model: str = ""
    fit: dict = field(default_factory=dict)   # steps, shapes, median and worst relative error, when
    stderr: dict = field(default_factory=dict)  # term -> standard error of its coefficient (s)
    covariance: tuple = ()                    # the coefficients' covariance, TERMS x TERMS (s^2)

    def __post_init__(self):
        for name in TERMS:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"step cost: {name} must be a finite number >= 0, got {v!r}")
        if self.c0 + self.c_prefill + self.c_decode <= 0:
            raise ValueError("step cost: c0, c_prefill and c_decode are all 0: every pass would take no time")
        pad = self.prompt_pad_rows
        if not isinstance(pad, int) or isinstance(pad, bool) or pad < 0:
            raise ValueError(f"step cost: prompt_pad_rows must be an integer >= 0, got {pad!r}")
        tile = self.attention_tile
        if tile is not None:
            if (not isinstance(tile, (list, tuple)) or len(tile) != 2
                    or not all(isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in tile)):
                raise ValueError(f"step cost: attention_tile must be [queries, keys], two integers > 0, "
                                 f"got {tile!r}")
            object.__setattr__(self, "attention_tile", tuple(tile))
        for name, low in (("spread", 0.0), ("spread_prompt", 0.0), ("extra_s", -math.inf),
                          ("extra_prompt_s", -math.inf)):
            spread = getattr(self, name)
            if not isinstance(spread, (list, tuple)) or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > low
                    for v in spread):
                what = "numbers > 0" if low == 0 else "finite numbers (seconds)"
                raise ValueError(f"step cost: {name} must be a list of {what}, got {spread!r}")
            object.__setattr__(self, name, tuple(float(v) for v in spread))
        if (self.extra_s or self.extra_prompt_s) and (self.spread or self.spread_prompt):
            raise ValueError("step cost: give a pass's spread as extra seconds or as factors, not both")
        cov = self.covariance
        if not cov:
            object.__setattr__(self, "covariance", ())
        else:
            if (not isinstance(cov, (list, tuple)) or len(cov) != len(TERMS)
                    or not all(isinstance(r, (list, tuple)) and len(r) == len(TERMS) for r in cov)
                    or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                               for r in cov for v in r)):
                raise ValueError(f"step cost: covariance must be {len(TERMS)} rows of {len(TERMS)} finite "
                                 f"numbers (one per term: {', '.join(TERMS)})")
            object.__setattr__(self, "covariance", tuple(tuple(float(v) for v in r) for r in cov))
        rho = self.rho
        if not isinstance(rho, (int, float)) or isinstance(rho, bool) or not -1.0 < rho < 1.0:
            raise ValueError(f"step cost: rho must be a number between -1 and 1 (exclusive), got {rho!r}")

    def features(self, shape: StepShape) -> list[float]:
        return features(shape, self.prompt_pad_rows, self.attention_tile)

    def predict(self, shape: StepShape) -> float:
        """The pass's seconds: the fit's own (its shape's median)."""
        return float(np.dot(self.coefficients(), self.features(shape)))

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
        fields = (*TERMS, "prompt_pad_rows", "attention_tile", "extra_s", "extra_prompt_s", "spread",
                  "spread_prompt", "rho", "machine", "model", "fit", "stderr", "covariance")
        known = {k: obj[k] for k in fields if k in obj}
        if not isinstance(known.get("stderr", {}), dict):
            raise ValueError(f"{path}: \"stderr\" must be an object of term -> seconds")
        try:
            return cls(**known)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def fit(shapes: list[StepShape], seconds: list[float], prompt_pad_rows: int = 0,
        attention_tile: tuple[int, int] | None = None, groups: list | None = None, **about) -> StepCost:
    """Least squares on relative error (a short pass counts as much as a long one), negative
    coefficients dropped; `prompt_pad_rows` and `attention_tile` say how the engine timed pads
    and tiles its prompt passes (features); `about` sets machine and model.

    The passes of one shape enter once, as their median time (robust to the odd pass another
    process slowed). Weighting each by 1 / its measured time biases the fit low (a slowed pass
    counts for less than one that ran fast), so the weights become 1 / the fitted time and the
    fit is repeated until they settle (iteratively reweighted least squares).

    The standard errors: with `groups` (each pass's (workload, run of it): calibrate runs every
    workload REPEATS times, in rounds spread over its minute), the spread of the fit over the
    runs drawn again with replacement, within each workload, and over the rounds' levels drawn
    again (`_resampled`); a residual sees the noise of passes close together in time, the runs
    and rounds also how the host's speed moved between them (docs/twin.md, section 1). Without,
    or when a workload ran once, the weighted fit's own: the residuals' variance times
    (A^T A)^-1. The extras are the quantiles of the seconds each pass
    ran over the fit's time for its shape: the passes holding prompt rows (`extra_prompt_s`), and
    the rest (`extra_s`); `rho` is how those extras follow each other, pass after pass in the
    order given (`_lag1`)."""
    coef, cov, rel, n_shapes = _fit(shapes, seconds, prompt_pad_rows, attention_tile)
    residual_se = np.sqrt(np.maximum(np.diag(cov), 0.0))
    fitted = np.array([features(s, prompt_pad_rows, attention_tile) for s in shapes]) @ coef  # per pass
    resampled = (_resampled(shapes, seconds, groups, fitted, prompt_pad_rows, attention_tile)
                 if groups else None)
    if resampled is not None:
        cov, levels = resampled
    every = np.asarray(seconds, dtype=np.float64)
    # each pass's seconds over the fit's for its shape, in the order given: what the twin adds
    extra = (every - fitted).tolist()
    rel_pass = np.abs(extra) / every
    spreads = {}
    for prompt in (True, False):
        extras = [e for s, e in zip(shapes, extra) if bool(s.prefill_rows) == prompt]
        quantiles = (np.arange(SPREAD_POINTS) + 0.5) / SPREAD_POINTS
        spreads[prompt] = tuple(np.quantile(extras, quantiles).tolist() if extras else [])
    about = dict(about)
    about["fit"] = {**about.get("fit", {}), "steps": len(shapes), "shapes": n_shapes,
                    "median_rel_error": float(np.median(rel)), "p90_rel_error": float(np.percentile(rel, 90)),
                    "max_rel_error": float(rel.max()), "pass_median_rel_error": float(np.median(rel_pass)),
                    "stderr_from": "runs and rounds resampled" if resampled is not None else "residuals",
                    "residual_stderr": {name: float(e) for name, e in zip(TERMS, residual_se)}}
    if resampled is not None:
        about["fit"]["round_levels"] = levels.tolist()
    se = np.sqrt(np.maximum(np.diag(cov), 0.0))
    return StepCost(**dict(zip(TERMS, (float(c) for c in coef))), **about,
                    prompt_pad_rows=prompt_pad_rows, attention_tile=attention_tile,
                    extra_s=spreads[False], extra_prompt_s=spreads[True], rho=_lag1(shapes, extra),
                    stderr={name: float(e) for name, e in zip(TERMS, se)}, covariance=cov.tolist())


def _fit(shapes, seconds, pad, tile) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(coefficients, their covariance from the residuals, each shape's relative error, shapes)."""
    by_shape: dict[StepShape, list[float]] = {}
    for s, t in zip(shapes, seconds):
        by_shape.setdefault(s, []).append(t)
    if len(by_shape) < len(TERMS):
        raise ValueError(f"fitting a step cost needs passes of at least {len(TERMS)} different shapes, "
                         f"got {len(by_shape)}")
    x = np.array([features(s, pad, tile) for s in by_shape], dtype=np.float64)
    y = np.array([np.median(ts) for ts in by_shape.values()], dtype=np.float64)
    coef, _ = _nonnegative_lstsq(x, y, 1.0 / y)
    for _ in range(REWEIGHTS):
        w = 1.0 / np.maximum(x @ coef, y.min() * 0.01)
        coef, cov = _nonnegative_lstsq(x, y, w)
    return coef, cov, np.abs(x @ coef - y) / y, len(by_shape)


RESAMPLES = 200   # draws of the runs for the standard errors (seeded: the same passes, the same errors)


def _resampled(shapes, seconds, groups, fitted, pad, tile) -> tuple[np.ndarray, np.ndarray] | None:
    """(the coefficients' covariance, each round's level) over the runs drawn again: `groups`
    gives each pass's (workload, run); the k-th run of every workload is round k.

    A round's passes share the host's moment: each round's level is the median of its passes'
    times over the fit's (`fitted`); the passes, their round's level divided out, are drawn by
    runs, for every workload as many of its runs as it had, with replacement (a stratified
    block bootstrap: a run's passes are drawn together), and each draw's fit is scaled by the
    mean of as many rounds' levels drawn with replacement. The levels drawn with the runs instead
    would be drawn for each workload alone, and a host slow for a whole round would count about
    one workload's share of its weight (docs/twin.md, section 1). Drawn so, n runs give a mean
    (n - 1) / n of its variance (the bootstrap's plug-in variance divides by n, not n - 1), so
    the covariance is scaled by n / (n - 1), n the fewest runs of a workload. None when a
    workload ran only once (its runs say nothing of their spread)."""
    runs: dict = {}
    for i, (workload, run) in enumerate(groups):
        runs.setdefault(workload, {}).setdefault(run, []).append(i)
    n = min(len(r) for r in runs.values())
    if n < 2:
        return None
    round_of = np.zeros(len(seconds), dtype=np.int64)
    for by_run in runs.values():
        for k, run in enumerate(sorted(by_run)):
            round_of[by_run[run]] = k
    ratio = np.asarray(seconds, dtype=np.float64) / fitted
    levels = np.array([np.median(ratio[round_of == k]) for k in range(round_of.max() + 1)])
    levels /= np.exp(np.mean(np.log(levels)))   # about 1: the fit's own level
    steady = (np.asarray(seconds, dtype=np.float64) / levels[round_of]).tolist()
    rng = np.random.default_rng(0)
    draws = []
    for _ in range(RESAMPLES):
        picked: list[int] = []
        for by_run in runs.values():
            each = list(by_run.values())
            for k in rng.integers(len(each), size=len(each)):
                picked += each[k]
        level = levels[rng.integers(len(levels), size=len(levels))].mean()
        try:
            draws.append(level * _fit([shapes[i] for i in picked], [steady[i] for i in picked], pad, tile)[0])
        except ValueError:   # a draw of too few shapes says nothing
            continue
    if len(draws) < RESAMPLES // 2:
        return None
    return np.atleast_2d(np.cov(np.array(draws).T, ddof=1)) * n / (n - 1), levels


REWEIGHTS = 5
NORMAL = NormalDist()
MIN_SHARE = 0.5    # of its fitted time, the least a pass drawn with an extra runs
RHO_LIMIT = 0.99   # a fitted rho is kept inside (-1, 1): at 1 a run would draw one factor for good


def _lag1(shapes: list[StepShape], extra: list[float]) -> float:
    """The lag-1 correlation of consecutive passes' draws (`extra`: each pass's seconds over the
    fit's, ranked within its kind (ties at their mean rank) and turned into a normal score, the
    scale `PassTimes` draws on); 0 with fewer than four passes or no spread."""
    score = np.zeros(len(extra))
    for prompt in (True, False):
        kind = [i for i, s in enumerate(shapes) if bool(s.prefill_rows) == prompt]
        if not kind:
            continue
        values = np.round([extra[i] for i in kind], 9)   # equal extras (up to rounding) tie
        ranks = np.empty(len(kind))
        ranks[np.argsort(values)] = np.arange(len(kind))
        _, tie = np.unique(values, return_inverse=True)
        ranks = (np.bincount(tie, ranks) / np.bincount(tie))[tie]
        score[kind] = [NORMAL.inv_cdf((rank + 0.5) / len(kind)) for rank in ranks]
    a, b = score[:-1], score[1:]
    if len(a) < 3 or a.std() == 0 or b.std() == 0:
        return 0.0
    return float(np.clip(np.corrcoef(a, b)[0, 1], -RHO_LIMIT, RHO_LIMIT))


class PassTimes:
    """One run's pass times: the cost's time for each shape plus an extra from its kind's extras
    (or times a factor from its kind's spread, in a cost that gives factors), drawn (seeded) as the
    calibration saw them follow each other: a chain of normal scores z' = rho z + sqrt(1 - rho^2) e,
    each turned into its quantile of the extras (a Gaussian copula: every draw keeps their
    distribution; rho 0 draws each alone). A pass runs at least MIN_SHARE of the cost's time (a
    large negative extra came from a larger pass). Neither: every pass takes the cost's time."""

    def __init__(self, cost: StepCost, seed: int = 0):
        self.cost, self.rng = cost, random.Random(seed)
        self.z: float | None = None   # the last pass's normal score

    def __call__(self, shape: StepShape) -> float:
        cost = self.cost
        t = cost.predict(shape)
        prompt = bool(shape.prefill_rows)
        extra = cost.extra_prompt_s if prompt and cost.extra_prompt_s else cost.extra_s
        spread = cost.spread_prompt if prompt and cost.spread_prompt else cost.spread
        if not (extra or spread):
            return t
        e = self.rng.gauss(0.0, 1.0)
        self.z = e if self.z is None else cost.rho * self.z + math.sqrt(1.0 - cost.rho ** 2) * e
        at = NORMAL.cdf(self.z)
        if extra:
            return max(t + extra[min(int(at * len(extra)), len(extra) - 1)], MIN_SHARE * t)
        return t * spread[min(int(at * len(spread)), len(spread) - 1)]


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted least squares; the most negative term dropped and the rest fitted again until
    none is negative (a time never shrinks with more work). Returns the coefficients and their
    covariance (0 for a dropped term, and for all when the fit has no spare equations)."""
    keep = [i for i in range(x.shape[1]) if x[:, i].any()]
    while True:
        a = x[:, keep] * w[:, None]
        scale = np.abs(a).max(axis=0)
        sol = np.linalg.lstsq(a / scale, y * w, rcond=None)[0] / scale
        if (sol >= 0).all() or len(keep) == 1:
            break
        del keep[int(np.argmin(sol))]
    coef, cov = np.zeros(x.shape[1]), np.zeros((x.shape[1], x.shape[1]))
    coef[keep] = np.maximum(sol, 0.0)
    spare = len(y) - len(keep)
    if spare > 0:
        resid = (y - x[:, keep] @ sol) * w
        an = a / scale
        cov[np.ix_(keep, keep)] = np.linalg.pinv(an.T @ an) * (resid @ resid / spare) / np.outer(scale, scale)
    return coef, cov
