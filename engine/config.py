"""Model hyper-parameters and architecture features read from GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ModelLoadError

MAX_DIM = 1 << 24

# What each architecture changes in the llama block, as llama.cpp's graphs do
# (src/models/{llama,qwen2,qwen3,gemma3}.cpp). rope_neox: RoPE rotates the pairs (i, i + hd/2)
# (llama.cpp's NEOX type; llama GGUFs have Q/K rows permuted for adjacent pairs instead).
ARCHITECTURES = {
    "llama": {},
    "qwen2": {"rope_neox": True},                       # + Q/K/V biases (found in the file)
    "qwen3": {"rope_neox": True, "qk_norm": True},
    # Gemma 3: embeddings x sqrt(d), QK-norm, norms after attention and FFN, GELU-tanh FFN,
    # sliding-window attention on 5 of every 6 layers with a local RoPE base of 10,000.
    # Its GGUF norm weights already hold 1 + w (llama.cpp's converter adds the 1), so they
    # multiply as stored, as in llama.cpp's graph.
    "gemma3": {"rope_neox": True, "qk_norm": True, "post_norms": True, "ffn_act": "gelu_tanh",
               "scale_embeddings": True, "swa_pattern": 6, "rope_base_local": 10000.0},
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


@dataclass(frozen=True)
class ModelConfig:
    """Shapes, constants and architecture features of a llama-family model."""

    n_layers: int
    d_model: int
    n_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rope_base: float
    norm_eps: float
    rope_neox: bool = False        # RoPE pairs (i, i + hd/2) instead of (2i, 2i+1)
    qkv_bias: bool = False         # Q/K/V projections have biases (qwen2)
    qk_norm: bool = False          # RMSNorm over each Q and K head before RoPE
    post_norms: bool = False       # RMSNorm on the attention and FFN outputs (gemma3)
    ffn_act: str = "silu"          # gate activation: "silu" or "gelu_tanh"
    scale_embeddings: bool = False  # embeddings x sqrt(d_model)
    sliding_window: int = 0        # keys a sliding layer's query sees (itself included); 0: none
    swa_pattern: int = 0           # layer i slides when i % swa_pattern < swa_pattern - 1
    rope_base_local: float = 0.0   # RoPE base of sliding layers
    rope_scale: float = 1.0        # linear RoPE scaling of full-attention layers (positions / factor)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_window and self.swa_pattern
                    and layer % self.swa_pattern < self.swa_pattern - 1)

    def layer_window(self, layer: int) -> int:
        """Keys a query of this layer sees (itself included); 0 means all before it."""
        return self.sliding_window if self.is_sliding(layer) else 0

    def layer_rope(self, layer: int) -> tuple[float, float]:
        """(RoPE base, position scale) of one layer."""
        if self.is_sliding(layer):
            return self.rope_base_local, 1.0
        return self.rope_base, self.rope_scale

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.d_model) if self.scale_embeddings else 1.0

    def n_params(self, tied_output: bool = True) -> int:
        """Parameter count of the weights (embedding counted once when tied)."""
        d, q, kv = self.d_model, self.q_dim, self.kv_dim
        attn = d * (q + 2 * kv) + q * d + (q + 2 * kv) * self.qkv_bias
        ffn = 3 * d * self.n_ff
        norms = 2 * d * (2 if self.post_norms else 1) + 2 * self.head_dim * self.qk_norm
        embed = self.vocab_size * d
        out = 0 if tied_output else embed
        return self.n_layers * (attn + ffn + norms) + embed + out + d

    def describe(self) -> str:
        """One line of the features beyond plain llama (for the model bar and reports)."""
        parts = []
        if self.sliding_window:
            n = sum(self.is_sliding(i) for i in range(self.n_layers))
            parts.append(f"sliding window {self.sliding_window} on {n}/{self.n_layers} layers")
        if self.qk_norm:
            parts.append("QK-norm")
        if self.qkv_bias:
            parts.append("QKV bias")
        parts.append(f"head dim {self.head_dim}, {self.n_heads}/{self.n_kv_heads} heads")
        return ", ".join(parts)


def _fail(path: str, message: str):
    raise ModelLoadError(f"{path}: {message}")


def _require(meta: dict, key: str, path: str, kind=int):
    value = meta.get(key)
    if value is None:
        _fail(path, f"missing metadata key '{key}'")
    if isinstance(value, bool) or not isinstance(value, int | float):
        _fail(path, f"metadata '{key}' = {str(value)[:60]!r} is not a {kind.__name__}")
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError):
        _fail(path, f"metadata '{key}' = {str(value)[:60]!r} is not a {kind.__name__}")


def _optional(meta: dict, key: str, path: str, default, kind):
    return _require(meta, key, path, kind) if key in meta else kind(default)


def _in_range(path: str, key: str, value: int, low: int = 1, high: int = MAX_DIM) -> int:
    if not low <= value <= high:
        _fail(path, f"{key} = {value} is out of range ({low}..{high})")
    return value


def config_from_metadata(meta: dict, arch: str, path: str, qkv_bias: bool = False) -> ModelConfig:
    """The validated config of `arch` (vocab_size 0: the loader sets it from the embedding)."""
    if arch not in ARCHITECTURES:
        _fail(path, f"unsupported architecture '{arch}'; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    feats = ARCHITECTURES[arch]
    n_heads = _require(meta, f"{arch}.attention.head_count", path)
    d_model = _require(meta, f"{arch}.embedding_length", path)
    sizes = {
        "n_layers": _require(meta, f"{arch}.block_count", path),
        "d_model": d_model,
        "n_ff": _require(meta, f"{arch}.feed_forward_length", path),
        "n_heads": n_heads,
        "n_kv_heads": _optional(meta, f"{arch}.attention.head_count_kv", path, n_heads, int),
        "context_length": _optional(meta, f"{arch}.context_length", path, 2048, int),
    }
    for name, v in sizes.items():
        _in_range(path, name, v)
    if d_model % n_heads and f"{arch}.attention.key_length" not in meta:
        _fail(path, f"embedding_length {d_model}, head_count {n_heads} and head_count_kv "
                    f"{sizes['n_kv_heads']} do not divide evenly")
    head_dim = _optional(meta, f"{arch}.attention.key_length", path, d_model // n_heads, int)
    _in_range(path, f"{arch}.attention.key_length", head_dim, 1, 1 << 16)
    v_dim = _optional(meta, f"{arch}.attention.value_length", path, head_dim, int)
    if v_dim != head_dim:
        _fail(path, f"{arch}.attention.value_length {v_dim} differs from key_length {head_dim} "
                    f"(not supported)")
    if n_heads % sizes["n_kv_heads"]:
        _fail(path, f"embedding_length {d_model}, head_count {n_heads} and head_count_kv "
                    f"{sizes['n_kv_heads']} do not divide evenly")
    if head_dim % 2:
        _fail(path, f"head dimension {head_dim} must be even for RoPE")
    rope_base = _optional(meta, f"{arch}.rope.freq_base", path, 10000.0, float)
    if not (math.isfinite(rope_base) and rope_base > 1.0):
        _fail(path, f"{arch}.rope.freq_base = {rope_base} is not a finite number > 1")
    norm_eps = _optional(meta, f"{arch}.attention.layer_norm_rms_epsilon", path, 1e-5, float)
    if not (math.isfinite(norm_eps) and 0.0 <= norm_eps < 1.0):
        _fail(path, f"{arch}.attention.layer_norm_rms_epsilon = {norm_eps} is not in [0, 1)")
    extra = dict(feats)
    if feats.get("swa_pattern"):
        key = f"{arch}.attention.sliding_window"
        extra["sliding_window"] = _in_range(path, key, _require(meta, key, path))
    extra["rope_scale"] = _rope_scale(meta, arch, path)
    return ModelConfig(head_dim=head_dim, vocab_size=0, rope_base=rope_base, norm_eps=norm_eps,
                       qkv_bias=qkv_bias, **sizes, **extra)


def _rope_scale(meta: dict, arch: str, path: str) -> float:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return 1.0
    if kind != "linear":
        _fail(path, f"{arch}.rope.scaling.type '{kind}' is not supported (only linear)")
    factor = _optional(meta, f"{arch}.rope.scaling.factor", path, 1.0, float)
    if not (math.isfinite(factor) and 1.0 <= factor <= 1024.0):
        _fail(path, f"{arch}.rope.scaling.factor = {factor} is not in [1, 1024]")
    return 1.0 / factor
