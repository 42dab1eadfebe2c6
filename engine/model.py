"""The forward pass of llama, qwen2, qwen3 and gemma3 over paged KV, as small pure NumPy functions."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from .attention import AttentionPlan, attention_plan, paged_attention
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
    if not neox:
        return rotate_pairs(x, pair_rotation(cos, sin))
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]        # [N, H, hd/2]
    c, s = cos[:, None, :], sin[:, None, :]    # [N, 1, hd/2]
    out = np.empty_like(x)                     # [N, H, hd]
    out[..., :half] = a * c - b * s
    out[..., half:] = a * s + b * c
    return out


def pair_rotation(cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    # [N, 1, hd/2] complex64: adjacent pairs (x0, x1) as x0 + i x1 rotate by one complex product
    return (cos + 1j * sin).astype(np.complex64)[:, None, :]


def rotate_pairs(x: np.ndarray, rot: np.ndarray) -> np.ndarray:
    # x [N, H, hd] (last axis contiguous) -> [N, H, hd]: one ufunc call where the real form took ten
    return (x.view(np.complex64) * rot).view(np.float32)


def layer_ropes(cfg: ModelConfig, positions: np.ndarray,
                factors: np.ndarray | None = None) -> list[Callable[[np.ndarray], np.ndarray]]:
    """Every layer's RoPE as a function of x [N, H, hd] at `positions`; layers that share a
    RoPE base share one, its angles computed once per pass."""
    made: dict[tuple[float, float], functools.partial] = {}
    out = []
    for layer in range(cfg.n_layers):
        key = cfg.layer_rope(layer)
        if key not in made:
            cos, sin = rope_angles(positions, cfg.head_dim, *key, factors)  # [N, hd/2] each
            made[key] = (functools.partial(apply_rope, cos=cos, sin=sin, neox=True) if cfg.rope_neox
                         else functools.partial(rotate_pairs, rot=pair_rotation(cos, sin)))
        out.append(made[key])
    return out


# x [N, K] @ the weight named `name` (`layer`'s when given): [N, out]. The CPU backend's
# `linear` (engine/cpu/): how the weights are laid out and who computes them is its business.
Linear = Callable[..., np.ndarray]


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


def gated_ffn(x: np.ndarray, linear: Linear, layer: int, act_name: str = "silu") -> np.ndarray:
    gu = linear(x, "w_gate_up", layer)         # [N, 2*ff]
    ff = gu.shape[1] // 2
    g, u = gu[:, :ff], gu[:, ff:]              # [N, ff] each
    if act_name == "gelu_tanh":
        act = gelu_tanh(g)                     # [N, ff]
    else:
        act = np.exp(-g)                       # [N, ff]; silu(g) = g / (1 + e^-g)
        act += 1.0
        np.divide(g, act, out=act)
    act *= u
    return linear(act, "w_down", layer)        # [N, d]


def page_slots(rows: int, sessions: list[SeqSlots], counts: list[int]) -> tuple:
    """Pool page and row of every new position, sessions concatenated: two arrays, or two ints
    for one position (a lone stream's decode then writes its K/V by plain indexing, 3 us a layer, not 9)."""
    if counts == [1]:
        page, row = divmod(sessions[0].n_past, rows)
        return int(sessions[0].page_table[page]), row
    pages, offsets = [], []
    for s, n in zip(sessions, counts):
        pos = np.arange(s.n_past, s.n_past + n)
        pages.append(np.asarray(s.page_table, dtype=np.int64)[pos // rows])
        offsets.append(pos % rows)
    return np.concatenate(pages), np.concatenate(offsets)


def block(x: np.ndarray, w: Weights, linear: Linear, cfg: ModelConfig, layer: int, pool: KVPool,
          plan: AttentionPlan, rope: Callable[[np.ndarray], np.ndarray], slots: tuple) -> np.ndarray:
    """One transformer block over the concatenated new tokens of every session."""
    q_dim, kv, H, KV, hd = cfg.q_dim, cfg.kv_dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    N = x.shape[0]
    h = rms_norm(x, w.attn_norm[layer], cfg.norm_eps)            # [N, d]
    qkv = linear(h, "wqkv", layer)                               # [N, q_dim + 2kv]
    if w.bqkv is not None:
        qkv += w.bqkv[layer]                                     # [N, q_dim + 2kv]
    qk = qkv[:, :q_dim + kv].reshape(N, H + KV, hd)              # [N, H+KV, hd]
    if w.attn_q_norm is not None:
        qk = np.concatenate([rms_norm(qk[:, :H], w.attn_q_norm[layer], cfg.norm_eps),
                             rms_norm(qk[:, H:], w.attn_k_norm[layer], cfg.norm_eps)], axis=1)
    qk = rope(qk)                                                # [N, H+KV, hd]: one pass for q|k
    q, k = qk[:, :H], qk[:, H:]                                  # [N, H, hd], [N, KV, hd]
    v = qkv[:, q_dim + kv:].reshape(N, KV, hd)                   # [N, KV, hd]
    pool.k[layer, slots[0], slots[1]] = k
    pool.v[layer, slots[0], slots[1]] = v
    attn = paged_attention(q, pool, layer, plan, cfg.layer_window(layer))  # [N, q_dim]
    out = linear(attn, "wo", layer)                              # [N, d]
    if w.post_attn_norm is not None:
        out = rms_norm(out, w.post_attn_norm[layer], cfg.norm_eps)  # [N, d]
    x = x + out                                                  # [N, d]
    h = rms_norm(x, w.ffn_norm[layer], cfg.norm_eps)             # [N, d]
    out = gated_ffn(h, linear, layer, cfg.ffn_act)               # [N, d]
    if w.post_ffn_norm is not None:
        out = rms_norm(out, w.post_ffn_norm[layer], cfg.norm_eps)   # [N, d]
    return x + out                                               # [N, d]


def logit_rows(counts: list[int], n_logits: list[int] | None) -> np.ndarray:
    """Rows of the batch that get logits: each session's last one, or its last n_logits[i]."""
    ends = np.cumsum(counts)                                          # [B]
    if n_logits is None:
        return ends - 1
    return np.concatenate([np.arange(e - k, e) for e, k in zip(ends, n_logits)])


def prompt_sessions(prompt: bool | list[bool] | None, counts: list[int]) -> list[bool]:
    """`forward`'s `prompt` as one bool per session."""
    if prompt is None:
        return [n > 1 for n in counts]
    if isinstance(prompt, bool):
        return [prompt] * len(counts)
    if len(prompt) != len(counts):
        raise ValueError(f"prompt needs one bool per session: got {len(prompt)} for {len(counts)} sessions")
    return [bool(p) for p in prompt]


def forward(model: Model, pool: KVPool, sessions: list[SeqSlots], token_lists: list[list[int]],
            all_positions: bool = False, n_logits: list[int] | None = None,
            prompt: bool | list[bool] | None = None) -> np.ndarray:
    """Evaluate new tokens of several sessions in one pass, into the slots the caller allocated.

    Reads each session's page table and start, writes K/V of the new positions only, and
    changes no session. Returns logits after each session's last token [B, vocab], or
    after every new token [N, vocab] with `all_positions` (teacher forcing, tests), or
    after each session's last `n_logits[i]` tokens, concatenated (speculative verification).
    `prompt`: which sessions give prompt tokens (one bool for all, or one per session; None:
    those giving more than one). Their rows are computed as in any prompt pass, long or short
    (CpuBackend.prompt_linear, attention.tiled_attention), so a prefix cache hit's tail equals
    the miss's rows bit for bit (docs/perf-notes.md, "Hit == miss").
    """
    cfg, w, cpu = model.config, model.weights, model.backend
    counts = [len(t) for t in token_lists]
    tokens = np.concatenate([np.asarray(t, dtype=np.int64) for t in token_lists])
    positions = np.concatenate([np.arange(s.n_past, s.n_past + n) for s, n in zip(sessions, counts)])
    ropes = layer_ropes(cfg, positions, w.rope_freqs)               # per layer: x -> x rotated
    prompts = prompt_sessions(prompt, counts)
    slots = page_slots(pool.page_rows, sessions, counts)
    plan = attention_plan(pool.page_rows, sessions, counts, prompts)
    cpu.begin_pass(len(tokens), any(prompts))
    x = cpu.embed(tokens)                                            # [N, d]
    if cfg.scale_embeddings:
        x = x * np.float32(cfg.embed_scale)                          # [N, d]
    linear = cpu.prompt_linear if any(prompts) else cpu.linear
    for layer in range(cfg.n_layers):
        x = block(x, w, linear, cfg, layer, pool, plan, ropes[layer], slots)
    rows = slice(None) if all_positions else logit_rows(counts, n_logits)
    h = rms_norm(x[rows], w.output_norm, cfg.norm_eps)             # [B or N, d]
    logits = cpu.head(h, any(prompts))                               # [B or N, vocab]
    return logits.astype(np.float32, copy=False)
