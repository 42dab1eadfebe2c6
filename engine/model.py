"""The forward pass of llama, qwen2, qwen3 and gemma3 over paged KV, as small pure NumPy functions."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .block_manager import SeqSlots
from .config import ModelConfig
from .kv_pool import KVPool
from .loader import Model, Weights


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    # x [N, d], w [d] -> [N, d]; add.reduce / d is np.mean's own arithmetic, minus its Python layer
    ms = np.add.reduce(x * x, axis=-1, keepdims=True) / np.float32(x.shape[-1])  # [N, 1]
    return x * (1.0 / np.sqrt(ms + eps)) * w


def rope_angles(positions: np.ndarray, head_dim: int, base: float, scale: float = 1.0,
                factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [hd/2]
    if factors is not None:
        inv_freq = inv_freq / factors                                               # Llama 3's rope_freqs
    angles = (positions[:, None] * scale).astype(np.float64) * inv_freq[None, :]  # [N, hd/2]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool = False) -> np.ndarray:
    # x [N, H, hd]; llama GGUFs rotate ADJACENT pairs (2i, 2i+1), NEOX-type models (qwen2/3,
    # gemma3) the pairs (i, i + hd/2), as llama.cpp's rope types do
    half = x.shape[-1] // 2
    a, b = (x[..., :half], x[..., half:]) if neox else (x[..., 0::2], x[..., 1::2])  # [N, H, hd/2]
    c, s = cos[:, None, :], sin[:, None, :]    # [N, 1, hd/2]
    out = np.empty_like(x)                     # [N, H, hd]
    lo, hi = (out[..., :half], out[..., half:]) if neox else (out[..., 0::2], out[..., 1::2])
    lo[...] = a * c - b * s
    hi[...] = a * s + b * c
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    # in place over the last axis: x [..., S] is a fresh scores array nobody else holds
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True)
    return x


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
    qg = q.reshape(T, KV, R, hd).transpose(1, 2, 0, 3).reshape(KV, R * T, hd)  # [KV, R*T, hd]
    # Strided views stay on BLAS (each matrix has a unit stride): no copy of K/V here.
    scores = qg @ k.transpose(1, 2, 0)                                            # [KV, R*T, S]
    scores *= np.float32(1.0 / np.sqrt(hd))
    if T > 1 or key_start + window <= n_past:
        scores.reshape(KV, R, T, S)[...] += causal_bias(T, S, n_past, key_start, window)  # [KV, R, T, S]
    probs = softmax(scores)                                                       # [KV, R*T, S]
    out = probs @ v.transpose(1, 0, 2)                                            # [KV, R*T, hd]
    return out.reshape(KV, R, T, hd).transpose(2, 0, 1, 3).reshape(T, H * hd)     # [T, d]


def padding_bias(lengths: np.ndarray, S: int, window: int = 0) -> np.ndarray:
    # [B, S]: 0 on the keys session b's query (key index lengths[b] - 1) sees, -inf on the
    # padding after them and, with a window, on keys `window` or more positions before it
    s = np.arange(S)[None, :]                                                     # [1, S]
    hidden = s >= lengths[:, None]                                                # [B, S]
    if window:
        hidden |= s < lengths[:, None] - window
    return np.where(hidden, np.float32(-np.inf), np.float32(0.0))


def decode_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """One new query per session over its own keys, sessions padded to one length S."""
    B, H, hd = q.shape          # q [B, H, hd]
    _, S, KV, _ = k.shape       # k, v [B, S, KV, hd]; bias [B, S] hides each session's padding
    R = H // KV
    qg = q.reshape(B, KV, R, hd)                                                  # [B, KV, R, hd]
    scores = qg @ k.transpose(0, 2, 3, 1)                                         # [B, KV, R, S]
    scores *= np.float32(1.0 / np.sqrt(hd))
    scores += bias[:, None, None, :]                                              # [B, KV, R, S]
    probs = softmax(scores)                                                       # [B, KV, R, S]
    return (probs @ v.transpose(0, 2, 1, 3)).reshape(B, H * hd)                   # [B, H*hd]


SMALL_BATCH = range(2, 17)  # rows for which the column-block layout beats a plain GEMM


def linear(x: np.ndarray, w: Weights, name: str, layer: int | None = None) -> np.ndarray:
    """x @ W (one layer's when `layer` is given); 2-16 rows go through the column-block copy."""
    weight = getattr(w, name)
    if layer is not None:
        weight = weight[layer]
    if len(x) == 1:
        # A GEMV reads the plain layout at full bandwidth (measured: decode 1.1-1.2x the
        # 2-row GEMM over the blocks), and one stream then never maps the blocks at all.
        return (x[0] @ weight)[None]                                         # [1, out]
    blocks = w.blocked(name) if len(x) in SMALL_BATCH else None
    if blocks is None:
        return x @ weight                                                    # [N, out]
    if layer is not None:
        blocks = blocks[layer]
    return (x @ blocks).transpose(1, 0, 2).reshape(len(x), -1)              # [N, out]


def gelu_tanh(g: np.ndarray) -> np.ndarray:
    # [N, ff]: GELU's tanh approximation (llama.cpp's ggml_gelu, Gemma's gelu_pytorch_tanh)
    inner = g * g                              # [N, ff]
    inner *= np.float32(0.044715)
    inner += 1.0
    inner *= g
    inner *= np.float32(np.sqrt(2.0 / np.pi))
    np.tanh(inner, out=inner)
    inner += 1.0
    inner *= g
    inner *= np.float32(0.5)
    return inner


def gated_ffn(x: np.ndarray, w: Weights, layer: int, act_name: str = "silu") -> np.ndarray:
    gu = linear(x, w, "w_gate_up", layer)      # [N, 2*ff]
    ff = gu.shape[1] // 2
    g, u = gu[:, :ff], gu[:, ff:]              # [N, ff] each
    if act_name == "gelu_tanh":
        act = gelu_tanh(g)                     # [N, ff]
    else:
        act = np.exp(-g)                       # [N, ff]; silu(g) = g / (1 + e^-g)
        act += 1.0
        np.divide(g, act, out=act)
    act *= u
    return linear(act, w, "w_down", layer)     # [N, d]


def page_slots(rows: int, sessions: list[SeqSlots], counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Pool page and row of every new position, sessions concatenated."""
    pages, offsets = [], []
    for s, n in zip(sessions, counts):
        pos = np.arange(s.n_past, s.n_past + n)
        pages.append(np.asarray(s.page_table, dtype=np.int64)[pos // rows])
        offsets.append(pos % rows)
    return np.concatenate(pages), np.concatenate(offsets)


@dataclass
class AttentionPlan:
    """Which rows attend how: single-token sessions together (padded), the others one by one."""

    decode_rows: np.ndarray     # [B] rows of x holding one session's only new token
    decode_tables: list         # [B] each such session's page table
    decode_lengths: np.ndarray  # [B] positions each such session holds after this pass
    spans: list                 # (first row, rows, page table, n_past) of every multi-token session
    page_rows: int
    keys: dict = field(default_factory=dict)  # window -> (pages [B, P], bias [B, P*rows]), made once

    def decode_keys(self, window: int) -> tuple[np.ndarray, np.ndarray]:
        """The pages every single-token session reads at a layer with this window (padded with its
        last one) and the bias that hides padding and keys outside the window."""
        if window not in self.keys:
            rows, lengths = self.page_rows, self.decode_lengths
            firsts = np.array([window_first_page(n - 1, window, rows) for n in lengths], dtype=np.int64)
            tables = [t[f:-(-n // rows)] for t, f, n in zip(self.decode_tables, firsts, lengths)]
            pages = np.empty((len(tables), max(map(len, tables))), dtype=np.int64)   # [B, P]
            for j, t in enumerate(tables):
                pages[j, :len(t)] = t
                pages[j, len(t):] = t[-1]   # padding reads a real page; the bias hides it
            bias = padding_bias(lengths - firsts * rows, pages.shape[1] * rows, window)  # [B, P*rows]
            self.keys[window] = (pages, bias)
        return self.keys[window]


def attention_plan(rows: int, sessions: list[SeqSlots], counts: list[int]) -> AttentionPlan:
    """Group the batch once per forward, so every layer reuses the same index arrays."""
    starts = np.cumsum([0] + counts[:-1])
    single = [i for i, n in enumerate(counts) if n == 1]
    lengths = np.array([sessions[i].n_past + 1 for i in single], dtype=np.int64)  # [B]
    spans = [(int(starts[i]), n, sessions[i].page_table, sessions[i].n_past)
             for i, n in enumerate(counts) if n != 1]
    return AttentionPlan(starts[single].astype(np.int64), [sessions[i].page_table for i in single],
                         lengths, spans, rows)


def gather_kv(pool: KVPool, layer: int, page_table: list[int], n: int,
              first_page: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """K and V of positions first_page * page_rows .. n - 1 of one session at one layer."""
    c = pool.cfg
    pages = page_table[first_page:]
    m = n - first_page * pool.page_rows
    k = pool.k[layer, pages].reshape(-1, c.n_kv_heads, c.head_dim)[:m]  # [m, KV, hd]
    v = pool.v[layer, pages].reshape(-1, c.n_kv_heads, c.head_dim)[:m]  # [m, KV, hd]
    return k, v


def window_first_page(n_past: int, window: int, page_rows: int) -> int:
    """The first page a sliding layer reads: the one holding the oldest key the first new query sees."""
    return max(0, n_past - window + 1) // page_rows if window else 0


def paged_attention(q: np.ndarray, pool: KVPool, layer: int, plan: AttentionPlan, window: int) -> np.ndarray:
    """Attention of every new row over its own session's pages (the last `window` keys when set)."""
    N, H, hd = q.shape                                                   # q [N, H, hd]
    KV, rows = pool.cfg.n_kv_heads, pool.page_rows
    out = np.empty((N, H * hd), dtype=np.float32)                        # [N, H*hd]
    if len(plan.decode_rows):
        B = len(plan.decode_rows)
        pages, bias = plan.decode_keys(window)                           # [B, P], [B, P*rows]
        k = pool.k[layer][pages].reshape(B, -1, KV, hd)                  # [B, P*rows, KV, hd]
        v = pool.v[layer][pages].reshape(B, -1, KV, hd)                  # [B, P*rows, KV, hd]
        out[plan.decode_rows] = decode_attention(q[plan.decode_rows], k, v, bias)
    for start, n, table, n_past in plan.spans:
        first = window_first_page(n_past, window, rows)
        ks, vs = gather_kv(pool, layer, table, n_past + n, first)       # [m, KV, hd] each
        out[start:start + n] = attention(q[start:start + n], ks, vs, n_past, first * rows, window)
    return out


def block(x: np.ndarray, w: Weights, cfg: ModelConfig, layer: int, pool: KVPool,
          plan: AttentionPlan, cos: np.ndarray, sin: np.ndarray,
          slots: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """One transformer block over the concatenated new tokens of every session."""
    q_dim, kv, H, KV, hd = cfg.q_dim, cfg.kv_dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    N = x.shape[0]
    h = rms_norm(x, w.attn_norm[layer], cfg.norm_eps)            # [N, d]
    qkv = linear(h, w, "wqkv", layer)                            # [N, q_dim + 2kv]
    if w.bqkv is not None:
        qkv += w.bqkv[layer]                                     # [N, q_dim + 2kv]
    qk = qkv[:, :q_dim + kv].reshape(N, H + KV, hd)              # [N, H+KV, hd]
    if w.attn_q_norm is not None:
        qk = np.concatenate([rms_norm(qk[:, :H], w.attn_q_norm[layer], cfg.norm_eps),
                             rms_norm(qk[:, H:], w.attn_k_norm[layer], cfg.norm_eps)], axis=1)
    qk = apply_rope(qk, cos, sin, cfg.rope_neox)                 # [N, H+KV, hd]: one pass for q|k
    q, k = qk[:, :H], qk[:, H:]                                  # [N, H, hd], [N, KV, hd]
    v = qkv[:, q_dim + kv:].reshape(N, KV, hd)                   # [N, KV, hd]
    pool.k[layer, slots[0], slots[1]] = k
    pool.v[layer, slots[0], slots[1]] = v
    attn = paged_attention(q, pool, layer, plan, cfg.layer_window(layer))  # [N, q_dim]
    out = linear(attn, w, "wo", layer)                           # [N, d]
    if w.post_attn_norm is not None:
        out = rms_norm(out, w.post_attn_norm[layer], cfg.norm_eps)  # [N, d]
    x = x + out                                                  # [N, d]
    h = rms_norm(x, w.ffn_norm[layer], cfg.norm_eps)             # [N, d]
    out = gated_ffn(h, w, layer, cfg.ffn_act)                    # [N, d]
    if w.post_ffn_norm is not None:
        out = rms_norm(out, w.post_ffn_norm[layer], cfg.norm_eps)   # [N, d]
    return x + out                                               # [N, d]


def layer_angles(cfg: ModelConfig, positions: np.ndarray,
                 factors: np.ndarray | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """(cos, sin) [N, hd/2] of every layer; layers that share a RoPE base share the arrays."""
    made: dict[tuple[float, float], tuple[np.ndarray, np.ndarray]] = {}
    out = []
    for layer in range(cfg.n_layers):
        key = cfg.layer_rope(layer)
        if key not in made:
            made[key] = rope_angles(positions, cfg.head_dim, *key, factors)
        out.append(made[key])
    return out


def logit_rows(counts: list[int], n_logits: list[int] | None) -> np.ndarray:
    """Rows of the batch that get logits: each session's last one, or its last n_logits[i]."""
    ends = np.cumsum(counts)                                          # [B]
    if n_logits is None:
        return ends - 1
    return np.concatenate([np.arange(e - k, e) for e, k in zip(ends, n_logits)])


def forward(model: Model, pool: KVPool, sessions: list[SeqSlots], token_lists: list[list[int]],
            all_positions: bool = False, n_logits: list[int] | None = None) -> np.ndarray:
    """Evaluate new tokens of several sessions in one pass, into the slots the caller allocated.

    Reads each session's page table and start, writes K/V of the new positions only, and
    changes no session. Returns logits after each session's last token [B, vocab], or
    after every new token [N, vocab] with `all_positions` (teacher forcing, tests), or
    after each session's last `n_logits[i]` tokens, concatenated (speculative verification).
    """
    cfg, w = model.config, model.weights
    counts = [len(t) for t in token_lists]
    tokens = np.concatenate([np.asarray(t, dtype=np.int64) for t in token_lists])
    positions = np.concatenate([np.arange(s.n_past, s.n_past + n) for s, n in zip(sessions, counts)])
    angles = layer_angles(cfg, positions, w.rope_freqs)             # per layer: [N, hd/2] x 2
    slots = page_slots(pool.page_rows, sessions, counts)
    plan = attention_plan(pool.page_rows, sessions, counts)
    x = np.asarray(w.token_embd[tokens], dtype=np.float32)          # [N, d]
    if cfg.scale_embeddings:
        x = x * np.float32(cfg.embed_scale)                          # [N, d]
    for layer in range(cfg.n_layers):
        x = block(x, w, cfg, layer, pool, plan, *angles[layer], slots)
    rows = slice(None) if all_positions else logit_rows(counts, n_logits)
    h = rms_norm(x[rows], w.output_norm, cfg.norm_eps)             # [B or N, d]
    logits = linear(h, w, "output_t")                                # [B or N, vocab]
    return logits.astype(np.float32, copy=False)
