"""What runs a scheduler's pass: the model's forward pass over a KV pool, or a stand-in.

The scheduler plans a pass and hands the runner its `Batch`; the runner gives it a pool of
pages to hold (`new_pool`) and, per pass, the logits after each row the batch samples from
(`forward`), having recorded the batch's tokens in the pool. `ModelRunner` is the engine's
own: a KV pool and `eval_batch`. The digital twin (docs/design.md §16) runs the same
scheduler with a runner whose pages store nothing and whose pass is a step-cost prediction.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .api import create_kv_pool, eval_batch
from .block_manager import BlockManager
from .loader import Model
from .stream import Batch, SchedulerSettings


class Runner(Protocol):
    def new_pool(self, settings: SchedulerSettings) -> BlockManager: ...

    def forward(self, batch: Batch) -> np.ndarray: ...


class ModelRunner:
    """The model's forward pass over a KV pool (what `serve` runs)."""

    def __init__(self, model: Model):
        self.model = model

    def new_pool(self, settings: SchedulerSettings) -> BlockManager:
        return create_kv_pool(self.model, settings.page_rows, settings.pool_pages, kv_dtype=settings.kv_dtype)

    def forward(self, batch: Batch) -> np.ndarray:
        return eval_batch(self.model, batch.sessions(), batch.tokens(), n_logits=batch.n_logits())
