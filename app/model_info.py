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
        # architecture, tokenizer type and quantization mix, e.g. "gemma3 (sliding window 512 on
        # 15/18 layers, ...), SentencePiece tokenizer, Q4_K x27, Q5_0 x81, Q6_K x9, Q8_0 x10, F32 x109"
        "description": model.describe(),
        "quant_mix": model.quant_mix,
        "tokenizer_model": model.tokenizer_model,
        "sliding_window": int(cfg.sliding_window),
        "adds_bos": bool(model.tokenizer.add_bos),
    }
