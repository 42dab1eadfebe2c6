"""Model hyper-parameters read from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a llama-family model."""

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

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def n_params(self, tied_output: bool = True) -> int:
        """Parameter count of the weights (embedding counted once when tied)."""
        attn = self.d_model * (self.d_model + 2 * self.kv_dim) + self.d_model * self.d_model
        ffn = 3 * self.d_model * self.n_ff
        norms = 2 * self.d_model
        embed = self.vocab_size * self.d_model
        out = 0 if tied_output else embed
        return self.n_layers * (attn + ffn + norms) + embed + out + self.d_model
