"""Token sampling in llama.cpp's order: penalties, top-k, top-p, min-p, temperature."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# A penalty outside this range makes a logit overflow float32 (1e-40 turns 20 into inf and then
# the probabilities NaN); llama.cpp's useful range is about 1-2, so this refuses nothing real.
REPEAT_PENALTY_RANGE = (1e-3, 1e3)
_F32 = np.finfo(np.float32)


@dataclass
class SamplingParams:
    """Sampling settings; temperature <= 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    logit_bias: dict[int, float] | None = None  # OpenAI's: added to these tokens' logits first

    def validate(self) -> None:
        """ValueError for a setting that is out of range or not a finite number."""
        low, high = REPEAT_PENALTY_RANGE
        checks = [
            (all(math.isfinite(v) for v in (self.temperature, self.top_p, self.min_p, self.repeat_penalty)),
             "temperature, top_p, min_p and repeat_penalty must be finite numbers"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0 (0: off)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p < 1, "min_p must be in [0, 1)"),
            (low <= self.repeat_penalty <= high, f"repeat_penalty must be in [{low:g}, {high:g}]"),
            (self.repeat_last_n >= 0, "repeat_last_n must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"bad sampling setting: {message}")


def apply_repeat_penalty(logits: np.ndarray, recent: list[int], penalty: float) -> np.ndarray:
    """llama.cpp's penalty: divide positive logits, multiply negative ones, of recent tokens."""
    if penalty == 1.0 or not recent:
        return logits
    out = logits.copy()
    ids = np.unique(np.asarray(recent, dtype=np.int64))
    vals = out[ids]
    out[ids] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def filter_candidates(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Candidate ids and their logits after top-k, top-p and min-p, sorted descending."""
    k = p.top_k if 0 < p.top_k < len(logits) else len(logits)
    ids = np.argpartition(-logits, k - 1)[:k] if k < len(logits) else np.arange(len(logits))
    ids = ids[np.argsort(-logits[ids], kind="stable")]
    vals = logits[ids].astype(np.float64)
    if p.top_p < 1.0:
        probs = np.exp(vals - vals[0])
        probs /= probs.sum()
        keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
        ids, vals = ids[:keep], vals[:keep]
    if p.min_p > 0.0:
        keep = vals >= vals[0] + np.log(p.min_p)
        ids, vals = ids[keep], vals[keep]
    return ids, vals


class Sampler:
    """A seedable sampler with its own numpy Generator."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        self.params.validate()
        self.rng = np.random.default_rng(self.params.seed)

    def sample(self, logits: np.ndarray, history: list[int] | None = None) -> int:
        p = self.params
        recent = (history or [])[-p.repeat_last_n:] if p.repeat_last_n else []
        logits = apply_repeat_penalty(np.asarray(logits, dtype=np.float32), recent, p.repeat_penalty)
        if p.logit_bias:
            logits = logits.copy()  # never the model's own buffer
            ids = np.fromiter(p.logit_bias, dtype=np.int64, count=len(p.logit_bias))
            logits[ids] += np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(ids))
        # finite logits keep every probability finite (inf - inf is the NaN numpy refuses to draw
        # from); a NaN logit (a broken model) becomes the least likely token, never the chosen one.
        # One isfinite pass first: nan_to_num's three passes and copy cost 0.12 ms a token.
        if not np.isfinite(logits).all():
            logits = np.nan_to_num(logits, nan=_F32.min, posinf=_F32.max, neginf=_F32.min)
        if p.temperature <= 0:
            return int(np.argmax(logits))
        ids, vals = filter_candidates(logits, p)
        probs = np.exp((vals - vals[0]) / p.temperature)
        probs /= probs.sum()
        return int(ids[self.rng.choice(len(ids), p=probs)])
