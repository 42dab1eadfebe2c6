"""`prefixlab replay --synthesize N OUT`: a seeded Mooncake-format trace with Zipf-shared prefixes.

Each request starts with one of `prefixes` shared prefixes (1 to 16 blocks; the
k-th most popular is chosen with probability proportional to 1 / k^`zipf`), then
1 to 8 blocks of its own, the last one partial; arrivals are Poisson at `rate`
requests/s and answers 16 to 512 tokens. Rows are generated and written in chunks,
so any N costs the same memory.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .trace import MOONCAKE_BLOCK, write_mooncake

CHUNK = 10_000
MAX_SYNTHESIZE = 10_000_000  # about 1.5 GB of JSONL; the shared prefixes' table grows with it


def synthesize_rows(n: int, seed: int = 0, prefixes: int | None = None, zipf: float = 1.1,
                    rate: float = 3.3, block: int = MOONCAKE_BLOCK) -> Iterator[dict]:
    """n Mooncake rows ({timestamp ms, input_length, output_length, hash_ids}), reproducible by seed."""
    if not 1 <= n <= MAX_SYNTHESIZE:
        raise ValueError(f"--synthesize takes a request count from 1 to {MAX_SYNTHESIZE:,}, got {n:,}")
    rng = np.random.default_rng(seed)
    k = prefixes or max(16, n // 100)
    weights = 1.0 / np.arange(1, k + 1) ** zipf
    weights /= weights.sum()
    lengths = rng.integers(1, 17, size=k)           # blocks of each shared prefix
    starts = np.concatenate([[0], np.cumsum(lengths)])  # prefix p owns ids starts[p] .. starts[p+1]-1
    next_id = int(starts[-1])                       # ids past the prefixes: one request's own blocks
    t = 0.0
    for lo in range(0, n, CHUNK):
        m = min(CHUNK, n - lo)
        picks = rng.choice(k, size=m, p=weights)
        own = rng.integers(1, 9, size=m)
        short = rng.integers(0, block, size=m)       # the last block's missing tokens
        outs = rng.integers(16, 513, size=m)
        gaps = rng.exponential(1.0 / rate, size=m)
        cols = (picks.tolist(), own.tolist(), short.tolist(), outs.tolist(), gaps.tolist())
        for p, o, s, out, gap in zip(*cols):
            t += gap
            shared = list(range(int(starts[p]), int(starts[p + 1])))
            ids = shared + list(range(next_id, next_id + o))
            next_id += o
            yield {"timestamp": int(t * 1000), "input_length": len(ids) * block - s,
                   "output_length": out, "hash_ids": ids}


def synthesize(n: int, path: str, seed: int = 0) -> int:
    """Write the trace to `path` atomically; return the request count."""
    return write_mooncake(path, synthesize_rows(n, seed))
