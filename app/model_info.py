"""A loaded model described as plain data (what the model bar and reports show)."""

from __future__ import annotations

import os


def model_info(model) -> dict:
    """Name, architecture, quantization and sizes of an engine Model, as a plain dict."""
    cfg = model.config
    return {
        "path": model.path,
        "file": os.path.basename(model.path),
        "name": model.name,
        "arch": model.arch,
        "quant": model.quant,
        "n_params": int(model.n_params),
        "context_length": int(cfg.context_length),
        "n_layers": int(cfg.n_layers),
        "d_model": int(cfg.d_model),
        "n_heads": int(cfg.n_heads),
        "n_kv_heads": int(cfg.n_kv_heads),
        "head_dim": int(cfg.head_dim),
        "vocab_size": int(cfg.vocab_size),
        "file_size": int(model.file_size),
        "load_seconds": float(model.load_seconds),
        "from_image": bool(model.from_image),
        "template_warning": model.tokenizer.template_warning,
    }
