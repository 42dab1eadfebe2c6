"""Attention over the paged KV pool: causal prefill spans, and batched decode that reads the
pages the decoding sessions share (a cached system prompt) once for all of them."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from .block_manager import SeqSlots
from .kv_pool import KVPool


def unnormalized_softmax(x: np.ndarray) -> np.ndarray:
    # exp(x - row max) in place over the last axis (x [..., S] is a fresh scores array nobody
    # else holds); the caller divides its [..., hd] output by row_sums, not the [..., S] weights
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    return x


def row_sums(w: np.ndarray) -> np.ndarray:
    # w [..., S] -> [..., 1], as a GEMM against two columns of ones, not a GEMV: the GEMV's
    # blocking over S follows S itself, so a row's sum changed with the keys that follow it
    # (masked zeros) and a cached prefix differed from a miss's own rows (docs/design.md §7);
    # the GEMM sums each row in the same order for any S, as `weights @ v` does (2-5 us a layer)
    return (w @ ones(w.shape[-1]))[..., :1]


def ones(n: int) -> np.ndarray:
    # [n, 2] float32 ones: a view of one array that grows, not a new one per layer (each
    # thread slices the array it checked, so another thread's growing cannot shrink it)
    global _ones
    have = _ones
    if len(have) < n:
        have = _ones = np.ones((max(n, 2 * len(have)), 2), dtype=np.float32)
    return have[:n]


_ones = np.ones((1024, 2), dtype=np.float32)


def causal_bias(T: int, S: int, n_past: int, key_start: int = 0, window: int = 0) -> np.ndarray:
    # [T, S]: 0 where query t (at position n_past + t) may see key s (at key_start + s), else -inf:
    # not after it, and with a window, fewer than `window` positions before it (llama.cpp's SWA)
    gap = (n_past + np.arange(T))[:, None] - (key_start + np.arange(S))[None, :]  # [T, S]
    hidden = (gap < 0) | (gap >= window) if window else gap < 0
    return np.where(hidden, np.float32(-np.inf), np.float32(0.0))


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_past: int,
              key_start: int = 0, window: int = 0) -> np.ndarray:
    """Causal grouped-query attention of T new queries over S keys at positions key_start.. n_past + T - 1."""
    T, H, hd = q.shape          # q [T, H, hd]
    S, KV, _ = k.shape          # k, v [S, KV, hd]
    R = H // KV
    # the scale goes on the queries as they are regrouped (T*H*hd products, not T*H*S); one query
    # (a lone stream's decode) is grouped as it lies
    if T == 1:
        qg = q.reshape(KV, R, hd) * query_scale(hd)                              # [KV, R, hd]
    else:
        qg = np.empty((KV, R, T, hd), dtype=np.float32)                           # [KV, R, T, hd]
        np.multiply(q.reshape(T, KV, R, hd).transpose(1, 2, 0, 3), query_scale(hd), out=qg)
        qg = qg.reshape(KV, R * T, hd)                                            # [KV, R*T, hd]
    # Strided views stay on BLAS (each matrix has a unit stride): no copy of K/V here.
    scores = qg @ k.transpose(1, 2, 0)                                            # [KV, R*T, S]
    if T > 1 or (window and key_start + window <= n_past):  # else every key is visible
        scores.reshape(KV, R, T, S)[...] += causal_bias(T, S, n_past, key_start, window)  # [KV, R, T, S]
    weights = unnormalized_softmax(scores)                                        # [KV, R*T, S]
    out = weights @ v.transpose(1, 0, 2)                                          # [KV, R*T, hd]
    out /= row_sums(weights)                                                      # [KV, R*T, hd]
    if T == 1:
        return out.reshape(1, H * hd)                                             # [1, d]: as it lies
    return out.reshape(KV, R, T, hd).transpose(2, 0, 1, 3).reshape(T, H * hd)     # [T, d]


QUERY_TILE = 32   # a prompt span's queries per GEMM (tiled_attention)
KEY_TILE = 128    # and keys per GEMM, tiles aligned to absolute positions


def tiled_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_past: int,
                    key_start: int = 0, window: int = 0) -> np.ndarray:
    """`attention` for a prompt span, each row's result the same in any pass: BLAS picks its
    kernel, and its blocking of the sum, by a GEMM's shape, so a row of a short hit's tail
    summed otherwise than the same row of the miss's pass, and a cached row otherwise with
    more keys after it (docs/perf-notes.md, "Hit == miss"). Here every GEMM has one shape:
    QUERY_TILE queries (zero-padded) by KEY_TILE keys at multiples of KEY_TILE from position
    0 (masked beyond the span's keys), and a row's tiles are summed in order of position, the
    tiles it cannot see adding exact zeros."""
    T, H, hd = q.shape          # q [T, H, hd]
    S, KV, _ = k.shape          # k, v [S, KV, hd]
    R, QT, KT = H // KV, QUERY_TILE, KEY_TILE
    lead = key_start % KT                                                         # masked keys before it
    nq, nb = -(-T // QT), -(-(lead + S) // KT)
    kp = np.zeros((KV, nb * KT, hd), dtype=np.float32)                            # [KV, nb*KT, hd]
    vp = np.zeros((KV, nb * KT, hd), dtype=np.float32)
    kp[:, lead:lead + S] = k.transpose(1, 0, 2)
    vp[:, lead:lead + S] = v.transpose(1, 0, 2)
    qp = np.zeros((KV, R, nq * QT, hd), dtype=np.float32)                         # [KV, R, nq*QT, hd]
    np.multiply(q.reshape(T, KV, R, hd).transpose(1, 2, 0, 3), query_scale(hd), out=qp[:, :, :T])
    qg = qp.reshape(KV, R, nq, QT, hd).transpose(0, 2, 1, 3, 4).reshape(KV, nq, 1, R * QT, hd)
    kt = kp.reshape(KV, 1, nb, KT, hd).transpose(0, 1, 2, 4, 3)                   # [KV, 1, nb, hd, KT]
    scores = qg @ kt                                                              # [KV, nq, nb, R*QT, KT]
    # padding queries stand at the last query's position, so no row is all -inf
    qpos = n_past + np.minimum(np.arange(nq * QT), T - 1)                         # [nq*QT]
    bias = causal_bias_at(qpos, key_start - lead + np.arange(nb * KT), key_start, key_start + S, window)
    bias = bias.reshape(nq, QT, nb, KT).transpose(0, 2, 1, 3)[:, :, None]          # [nq, nb, 1, QT, KT]
    scores.reshape(KV, nq, nb, R, QT, KT)[...] += bias
    scores -= scores.max(axis=(2, 4), keepdims=True)
    weights = np.exp(scores, out=scores)                                          # [KV, nq, nb, R*QT, KT]
    parts = weights @ vp.reshape(KV, 1, nb, KT, hd)                               # [KV, nq, nb, R*QT, hd]
    sums = weights @ ones(KT)                                                     # [KV, nq, nb, R*QT, 2]
    out, total = parts[:, :, 0], sums[:, :, 0, :, :1]
    for b in range(1, nb):      # in order of position, whatever the pass
        out += parts[:, :, b]
        total += sums[:, :, b, :, :1]
    out /= total                                                                  # [KV, nq, R*QT, hd]
    out = out.reshape(KV, nq, R, QT, hd).transpose(1, 3, 0, 2, 4).reshape(nq * QT, H * hd)
    return out[:T]                                                                # [T, d]


def causal_bias_at(qpos: np.ndarray, kpos: np.ndarray, first: int, end: int, window: int) -> np.ndarray:
    # [T, S]: 0 where a query at qpos may see the key at kpos (held: first <= kpos < end; not
    # after the query; with a window, fewer than `window` positions before it), else -inf
    gap = qpos[:, None] - kpos[None, :]                                           # [T, S]
    hidden = (gap < 0) | (kpos < first)[None, :] | (kpos >= end)[None, :]
    if window:
        hidden |= gap >= window
    return np.where(hidden, np.float32(-np.inf), np.float32(0.0))


@functools.lru_cache(maxsize=16)
def query_scale(hd: int) -> np.float32:
    return np.float32(1.0 / np.sqrt(hd))


def padding_bias(lengths: np.ndarray, S: int, window: int = 0) -> np.ndarray:
    # [B, S]: 0 on the keys session b's query (key index lengths[b] - 1) sees, -inf on the
    # padding after them and, with a window, on keys `window` or more positions before it
    s = np.arange(S)[None, :]                                                     # [1, S]
    hidden = s >= lengths[:, None]                                                # [B, S]
    if window:
        hidden |= s < lengths[:, None] - window
    return np.where(hidden, np.float32(-np.inf), np.float32(0.0))


def decode_attention(q: np.ndarray, own: tuple[np.ndarray, np.ndarray], bias: np.ndarray,
                     shared: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """One new query per session over its own keys (sessions padded to one length; `bias` hides
    the padding) and, when given, the keys every session shares. One softmax spans both."""
    B, H, hd = q.shape          # q [B, H, hd]
    ko, vo = own                # [B, So, KV, hd] each; bias [B, So]
    _, So, KV, _ = ko.shape
    R, Ss = H // KV, 0 if shared is None else shared[0].shape[0]
    # laid out per KV head, [KV, B, R, ...], so the shared keys' GEMM writes into the scores in
    # place; the scale goes on the queries (B*H*hd products, not B*H*S)
    qg = q.reshape(B, KV, R, hd) * query_scale(hd)                                # [B, KV, R, hd]
    scores = np.empty((KV, B, R, Ss + So), dtype=np.float32)                      # [KV, B, R, S]
    np.matmul(qg.transpose(1, 0, 2, 3), ko.transpose(2, 0, 3, 1), out=scores[..., Ss:])
    scores[..., Ss:] += bias[None, :, None, :]                                    # [KV, B, R, So]
    if shared is not None:
        ks, vs = shared         # [Ss, KV, hd] each: every session sees all of them
        # the shared keys as one GEMM per KV head over every session's queries, not B copies;
        # BLAS reads them as a contiguous copy in half the time it takes over the pool's strides
        qs = qg.transpose(1, 0, 2, 3).reshape(KV, B * R, hd)                      # [KV, B*R, hd]
        kt = np.ascontiguousarray(ks.transpose(1, 2, 0))                          # [KV, hd, Ss]
        np.matmul(qs, kt, out=scores[..., :Ss].reshape(KV, B * R, Ss))            # a view: [KV, B*R, Ss]
    weights = unnormalized_softmax(scores)                                        # [KV, B, R, S]
    out = weights[..., Ss:] @ vo.transpose(2, 0, 1, 3)                            # [KV, B, R, hd]
    if shared is not None:
        ps = weights[..., :Ss].reshape(KV, B * R, Ss)                             # [KV, B*R, Ss] view
        out += (ps @ vs.transpose(1, 0, 2)).reshape(KV, B, R, hd)
    out /= row_sums(weights)                                                      # [KV, B, R, hd]
    return out.transpose(1, 0, 2, 3).reshape(B, H * hd)                           # [B, H*hd]


@dataclass
class AttentionPlan:
    """Which rows attend how: two or more single-token sessions together (padded), the others one by one."""

    decode_rows: np.ndarray     # [B] rows of x holding one session's only new token
    decode_tables: list         # [B] each such session's page table
    decode_lengths: np.ndarray  # [B] positions each such session holds after this pass
    spans: list                 # (first row, rows, page table, n_past, prompt) of every other session
    page_rows: int
    keys: dict = field(default_factory=dict)  # window -> DecodeKeys, made once per forward
    pages: dict = field(default_factory=dict)  # (a span's first row, first page) -> its page_index

    def decode_keys(self, window: int) -> DecodeKeys:
        """The pages every single-token session reads at a layer with this window: the leading
        pages all of them share (full, so every query sees all their keys; none on sliding
        layers, whose windows start apart), then each one's own (padded with its last one)
        with the bias that hides padding and keys outside the window."""
        if window not in self.keys:
            rows, lengths = self.page_rows, self.decode_lengths
            firsts = np.array([window_first_page(n - 1, window, rows) for n in lengths], dtype=np.int64)
            tables = [t[f:-(-n // rows)] for t, f, n in zip(self.decode_tables, firsts, lengths)]
            c = 0 if window or len(tables) < 2 else shared_prefix(tables, int(lengths.min() - 1) // rows)
            tails = [t[c:] for t in tables]
            pages = np.empty((len(tails), max(map(len, tails))), dtype=np.int64)     # [B, P]
            for j, t in enumerate(tails):
                pages[j, :len(t)] = t
                pages[j, len(t):] = t[-1]   # padding reads a real page; the bias hides it
            bias = padding_bias(lengths - (firsts + c) * rows, pages.shape[1] * rows, window)  # [B, P*rows]
            shared = page_index(tables[0][:c]) if c else None
            self.keys[window] = DecodeKeys(shared, page_index(pages[0]) if len(tails) == 1 else pages, bias)
        return self.keys[window]


@dataclass
class DecodeKeys:
    shared: slice | list | None    # pages every decoding session reads whole
    own: slice | list | np.ndarray  # [B, P] each session's other pages, padded (one session: a list)
    bias: np.ndarray                # [B, P*rows] hides the padding and keys outside a window


def shared_prefix(tables: list, limit: int) -> int:
    """How many leading pages every table has in common, at most `limit`."""
    c = 0
    while c < limit and all(t[c] == tables[0][c] for t in tables):
        c += 1
    return c


def page_index(pages) -> slice | list:
    """An index of the pool's page axis: a slice (a view, no copy) when the pages lie side by
    side, as one stream's and a cached prefix's usually do, else the list of ids (a copy)."""
    ids = [int(p) for p in pages]
    return slice(ids[0], ids[-1] + 1) if ids == list(range(ids[0], ids[0] + len(ids))) else ids


def attention_plan(rows: int, sessions: list[SeqSlots], counts: list[int],
                   prompts: list[bool] | None = None) -> AttentionPlan:
    """Group the batch once per forward, so every layer reuses the same index arrays. A lone
    single-token session is a span: its keys are then a view of its pages, with no padding.
    A session whose `prompts` entry is true is a span that attends as any prompt does (tiled_attention)."""
    prompts = prompts or [False] * len(counts)
    starts = np.cumsum([0] + counts[:-1])
    single = [i for i, n in enumerate(counts) if n == 1 and not prompts[i]]
    if len(single) == 1:
        single = []
    batched = set(single)
    lengths = np.array([sessions[i].n_past + 1 for i in single], dtype=np.int64)  # [B]
    spans = [(int(starts[i]), n, sessions[i].page_table, sessions[i].n_past, prompts[i])
             for i, n in enumerate(counts) if i not in batched]
    return AttentionPlan(starts[single].astype(np.int64), [sessions[i].page_table for i in single],
                         lengths, spans, rows)


def gather_kv(pool: KVPool, layer: int, pages: slice | list, m: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V of the first m positions of `pages` (page_index) at one layer."""
    c = pool.cfg
    k = pool.k[layer, pages].reshape(-1, c.n_kv_heads, c.head_dim)[:m]  # [m, KV, hd]
    v = pool.v[layer, pages].reshape(-1, c.n_kv_heads, c.head_dim)[:m]  # [m, KV, hd]
    return f32(k), f32(v)


def f32(a: np.ndarray) -> np.ndarray:
    """K/V as float32 for the math: a float16 pool's pages widened, a float32 pool's untouched."""
    return a if a.dtype is _F32 else a.astype(np.float32)


_F32 = np.dtype(np.float32)


def window_first_page(n_past: int, window: int, page_rows: int) -> int:
    """The first page a sliding layer reads: the one holding the oldest key the first new query sees."""
    return max(0, n_past - window + 1) // page_rows if window else 0


def paged_attention(q: np.ndarray, pool: KVPool, layer: int, plan: AttentionPlan, window: int) -> np.ndarray:
    """Attention of every new row over its own session's pages (the last `window` keys when set)."""
    N, H, hd = q.shape                                                   # q [N, H, hd]
    KV, rows = pool.cfg.n_kv_heads, pool.page_rows
    parts = []                                                           # (rows of x, their [n, H*hd])
    if len(plan.decode_rows):
        B, keys = len(plan.decode_rows), plan.decode_keys(window)
        k, v = pool.k[layer], pool.v[layer]                                 # [pages, rows, KV, hd]
        own = (f32(k[keys.own].reshape(B, -1, KV, hd)), f32(v[keys.own].reshape(B, -1, KV, hd)))
        shared = None if keys.shared is None else (                         # [Ss, KV, hd] each
            f32(k[keys.shared].reshape(-1, KV, hd)), f32(v[keys.shared].reshape(-1, KV, hd)))
        whole = B == N   # every row decodes (in order): no gather of q, no scatter of the answer
        parts.append((plan.decode_rows, decode_attention(q if whole else q[plan.decode_rows],
                                                         own, keys.bias, shared)))
    for start, n, table, n_past, prompt in plan.spans:
        first = window_first_page(n_past, window, rows)
        if (start, first) not in plan.pages:                            # once per pass, not per layer
            plan.pages[start, first] = page_index(table[first:])        # side by side: a view, no copy
        ks, vs = gather_kv(pool, layer, plan.pages[start, first], n_past + n - first * rows)
        attend = tiled_attention if prompt else attention
        parts.append((slice(start, start + n),
                      attend(q[start:start + n], ks, vs, n_past, first * rows, window)))
    if len(parts) == 1 and len(parts[0][1]) == N:                        # one part holds every row
        return parts[0][1]                                               # [N, H*hd]
    out = np.empty((N, H * hd), dtype=np.float32)                        # [N, H*hd]
    for at, part in parts:
        out[at] = part
    return out
