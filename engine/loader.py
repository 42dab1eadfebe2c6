"""load_model: a GGUF file to a ready Model (weights, config, tokenizer)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer

from .chat import checked_template
from .config import ModelConfig
from .cpu.backend import BLOCKED_WEIGHTS, CpuBackend
from .cpu.blas_threads import blas_threads
from .cpu.weight_image import image_dir, read_image, write_image
from .cpu.weight_layout import BLOCKS, to_blocks
from .errors import ModelLoadError
from .registry import resolve_model
from .tokenizer import TextTokenizer, build_tokenizer

if TYPE_CHECKING:  # gguf (0.1 s to import) is needed only to build an image: imported then
    from .gguf_loader import GGUFFile

TOKENIZER_KINDS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}
BIG_HEAD_BYTES = 256 << 20  # an output head this large is worth naming in the description

BLOCKS_SUFFIX = {k: "@" + k for k in BLOCKS}  # weight-image name of an array's blocks of each kind


@dataclass
class Weights:
    """Float32 weights, pre-transposed for `x @ W`, per-layer arrays stacked on axis 0."""

    token_embd: np.ndarray   # [vocab, d] (a view of output_t when tied: one copy of a 262k vocab, not two)
    output_norm: np.ndarray  # [d]
    output: np.ndarray       # [vocab, d]: a view of output_t (the embedding itself when tied)
    output_t: np.ndarray     # [d, vocab]: the output head, contiguous for `x @ W` (a GEMV 1.3x faster)
    attn_norm: np.ndarray    # [L, d]
    wqkv: np.ndarray         # [L, d, q_dim + 2*kv_dim]
    wo: np.ndarray           # [L, q_dim, d]
    ffn_norm: np.ndarray     # [L, d]
    w_gate_up: np.ndarray    # [L, d, 2*ff]
    w_down: np.ndarray       # [L, ff, d]
    bqkv: np.ndarray | None = None            # [L, q_dim + 2*kv_dim]: Q/K/V biases (qwen2)
    attn_q_norm: np.ndarray | None = None     # [L, head_dim]: QK-norm (qwen3, gemma3)
    attn_k_norm: np.ndarray | None = None     # [L, head_dim]
    post_attn_norm: np.ndarray | None = None  # [L, d]: norms of the block outputs (gemma3)
    post_ffn_norm: np.ndarray | None = None   # [L, d]
    rope_freqs: np.ndarray | None = None      # [head_dim/2]: RoPE frequency divisors (Llama 3.1+)

    def matmul_bytes(self) -> int:
        """Bytes of weights one decode step reads (every matmul plus the output head)."""
        return sum(a.nbytes for a in (self.wqkv, self.wo, self.w_gate_up, self.w_down, self.output_t))


@dataclass
class Model:
    """A loaded model: what `engine.load_model` returns."""

    path: str
    name: str
    arch: str
    quant: str
    config: ModelConfig
    weights: Weights = field(repr=False)
    tokenizer: TextTokenizer = field(repr=False)
    backend: CpuBackend = field(repr=False)  # how this machine reads the weights (engine/cpu/)
    file_size: int = 0
    n_params: int = 0
    load_seconds: float = 0.0
    from_image: bool = False
    quant_mix: str = ""        # tensor count per storage type, e.g. "Q4_K x27, Q5_0 x81, F32 x109"
    tokenizer_model: str = ""  # GGUF tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)

    def describe(self) -> str:
        """Architecture, tokenizer type and quantization mix in one line (model bar, report, bench)."""
        kind = TOKENIZER_KINDS.get(self.tokenizer_model, self.tokenizer_model or "unknown")
        text = f"{self.arch} ({self.config.describe()}), {kind} tokenizer, {self.quant_mix or self.quant}"
        head = self.weights.output_t.nbytes
        if head >= BIG_HEAD_BYTES:  # e.g. Gemma's 262,144-token vocabulary: the head bounds decode speed
            text += f"; every decoded token reads a {head / 1e6:.0f} MB output head"
        return text


def default_model_path() -> str:
    """The bundled SmolLM2 GGUF; ModelLoadError says how to install it when missing."""
    return resolve_model(None)


def _stacked(gf: GGUFFile, shape: tuple[int, ...], layer_array) -> np.ndarray:
    """Per-layer arrays filled into one [L, ...] array (no list of copies to stack)."""
    out = np.empty((gf.config.n_layers, *shape), dtype=np.float32)
    for i in range(gf.config.n_layers):
        out[i] = layer_array(i)
    return out


def _transposed(a: np.ndarray, rows: int = 1024) -> np.ndarray:
    """A contiguous a.T, copied 1024 rows at a time (2.6x faster than one strided copy of a 262k vocab)."""
    out = np.empty(a.shape[::-1], dtype=a.dtype)
    for i in range(0, a.shape[0], rows):
        out[:, i:i + rows] = a[i:i + rows].T
    return out


def _weight_arrays(gf: GGUFFile, with_blocks: bool = False):
    """Yield (name, float32 array) one at a time: dequantized, fused (QKV, gate+up), transposed for `x @ W`;
    with_blocks (the weight image) adds each matrix's column blocks.

    One at a time keeps a cold load's peak memory near the largest array, not the whole model.
    """
    c = gf.config
    d, q, kv, ff, hd = c.d_model, c.q_dim, c.kv_dim, c.n_ff, c.head_dim

    def fused(i: int, parts: tuple[str, ...], kind: str = "weight") -> np.ndarray:
        return np.concatenate([gf.tensor(f"blk.{i}.{p}.{kind}") for p in parts], axis=0).T

    def per_layer(shape: tuple[int, ...], name: str):
        return lambda: _stacked(gf, shape, lambda i: gf.tensor(f"blk.{i}.{name}.weight"))

    arrays = [
        ("output_norm", lambda: gf.tensor("output_norm.weight")),
        ("attn_norm", per_layer((d,), "attn_norm")),
        ("ffn_norm", per_layer((d,), "ffn_norm")),
        ("wqkv", lambda: _stacked(gf, (d, q + 2 * kv), lambda i: fused(i, ("attn_q", "attn_k", "attn_v")))),
        ("w_gate_up", lambda: _stacked(gf, (d, 2 * ff), lambda i: fused(i, ("ffn_gate", "ffn_up")))),
        ("wo", lambda: _stacked(gf, (q, d), lambda i: gf.tensor(f"blk.{i}.attn_output.weight").T)),
        ("w_down", lambda: _stacked(gf, (ff, d), lambda i: gf.tensor(f"blk.{i}.ffn_down.weight").T)),
    ]
    if c.qkv_bias:
        arrays.append(("bqkv", lambda: _stacked(gf, (q + 2 * kv,), lambda i: fused(
            i, ("attn_q", "attn_k", "attn_v"), "bias"))))
    if c.qk_norm:
        arrays += [("attn_q_norm", per_layer((hd,), "attn_q_norm")),
                   ("attn_k_norm", per_layer((hd,), "attn_k_norm"))]
    if c.post_norms:
        arrays += [("post_attn_norm", per_layer((d,), "post_attention_norm")),
                   ("post_ffn_norm", per_layer((d,), "post_ffw_norm"))]
    if "rope_freqs.weight" in gf.header.tensors:
        arrays.append(("rope_freqs", lambda: gf.tensor("rope_freqs.weight")))
    if not gf.tied_output:  # tied: the embedding rows are read from the output head's columns
        arrays.append(("token_embd", lambda: gf.tensor("token_embd.weight")))
    head = "token_embd.weight" if gf.tied_output else "output.weight"
    arrays.append(("output_t", lambda: _transposed(gf.tensor(head))))
    for name, make in arrays:
        arr = make()
        if not np.isfinite(arr).all():
            raise ModelLoadError(f"{gf.path}: weights '{name}' contain NaN or infinity")
        if name == "rope_freqs" and not (arr > 0).all():
            raise ModelLoadError(f"{gf.path}: rope_freqs.weight has a factor <= 0")
        yield name, arr
        for kind in BLOCKS if with_blocks and name in BLOCKED_WEIGHTS else ():
            blocks = to_blocks(arr, kind)
            if blocks is not None:  # on disk beside the plain array: the layout probe picks one to read
                yield name + BLOCKS_SUFFIX[kind], blocks
                del blocks          # one array at a time


def _flag(gf: GGUFFile, key: str, default: bool) -> bool:
    value = gf.metadata.get(key, default)
    if not isinstance(value, bool | int | np.integer):
        raise ModelLoadError(f"{gf.path}: metadata '{key}' = {str(value)[:40]!r} is not a boolean")
    return bool(value)


def _token_id(gf: GGUFFile, key: str) -> int | None:
    """A special token id from metadata; None when absent or outside the vocabulary (as llama.cpp)."""
    value = gf.metadata.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < gf.config.vocab_size:
        return int(value)
    return None


def _tokenizer_info(gf: GGUFFile) -> tuple[dict, Tokenizer]:
    """The tokenizer built from the GGUF's vocabulary, and the facts about it the image keeps."""
    from .gguf_loader import quant_mix, read_float_array, read_int_array, read_string_array
    meta = gf.metadata
    model = str(meta.get("tokenizer.ggml.model", ""))
    tokens = read_string_array(gf, "tokenizer.ggml.tokens") or []
    if len(tokens) > gf.config.vocab_size:
        # ids past the embedding would make every later eval fail
        raise ModelLoadError(f"{gf.path}: tokenizer.ggml.tokens has {len(tokens)} tokens but "
                             f"token_embd.weight only {gf.config.vocab_size} rows")
    spm = model == "llama"
    tk = build_tokenizer(
        gf.path, model, str(meta.get("tokenizer.ggml.pre", "default")),
        tokens, read_string_array(gf, "tokenizer.ggml.merges"),
        read_int_array(gf, "tokenizer.ggml.token_type"),
        scores=read_float_array(gf, "tokenizer.ggml.scores"),
        # llama.cpp's defaults for a SentencePiece vocabulary: a space prefix and a BOS
        add_space_prefix=_flag(gf, "tokenizer.ggml.add_space_prefix", spm),
        unk_id=_token_id(gf, "tokenizer.ggml.unknown_token_id"),
    )
    eos = [_token_id(gf, "tokenizer.ggml.eos_token_id"), _token_id(gf, "tokenizer.ggml.eot_token_id")]
    eos += [tk.token_to_id(t) for t in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>")]
    eos_ids = sorted({int(i) for i in eos if i is not None and 0 <= int(i) < gf.config.vocab_size})
    bos = _token_id(gf, "tokenizer.ggml.bos_token_id")
    return {
        "tokenizer_model": model,
        "chat_template": template if isinstance(template := meta.get("tokenizer.chat_template"), str) else "",
        "eos_ids": eos_ids,
        "bos_id": bos,
        "add_bos": _flag(gf, "tokenizer.ggml.add_bos_token", spm) and bos is not None,
        "quant_mix": quant_mix(gf.header.tensors.values()),
    }, tk


def _build(info: dict, arrays: dict[str, np.ndarray], path: str, size: int, t0: float,
           from_image: bool, tk: Tokenizer | None = None) -> Model:
    cfg = ModelConfig(**info["config"])
    template, warning = checked_template(info["chat_template"], info["arch"])
    tokenizer = TextTokenizer(
        tokenizer=tk or Tokenizer.from_str(info["tokenizer_json"]), chat_template=template,
        eos_ids=tuple(info["eos_ids"]), bos_id=info["bos_id"], add_bos=info["add_bos"],
        template_warning=warning)
    tied = info["tied_output"]
    head = arrays["output_t"].T                                  # [vocab, d] view
    plain = {k: v for k, v in arrays.items() if k != "token_embd" and "@" not in k}
    copies = {kind: {k[:-len(sfx)]: v for k, v in arrays.items() if k.endswith(sfx)}
              for kind, sfx in BLOCKS_SUFFIX.items()}
    weights = Weights(token_embd=head if tied else arrays["token_embd"], output=head, **plain)
    return Model(path=path, name=info["name"], arch=info["arch"], quant=info["quant"], config=cfg,
                 weights=weights, tokenizer=tokenizer,
                 backend=CpuBackend(weights, {k: c for k, c in copies.items() if c}), file_size=size,
                 n_params=cfg.n_params(tied_output=tied),
                 load_seconds=time.perf_counter() - t0, from_image=from_image,
                 quant_mix=info["quant_mix"], tokenizer_model=info["tokenizer_model"])


def _image_arrays(gf: GGUFFile, info: dict) -> dict[str, np.ndarray] | None:
    """Write the weight image array by array, then memory-map it; None when the cache is unwritable."""
    try:
        write_image(gf.path, gf.header_bytes, _weight_arrays(gf, with_blocks=True), info)
    except OSError:
        return None  # an unwritable cache only costs speed and memory
    mapped = read_image(gf.path)
    return mapped[0] if mapped is not None else None


def load_model(path: str | os.PathLike | None = None, use_image: bool = True) -> Model:
    """Load a GGUF: a file, a built-in model's name ("gemma3-270m"), or the bundled SmolLM2 when None."""
    t0 = time.perf_counter()
    model = _load(path, use_image, t0)
    model.backend.choose_layout(image_dir(model.path))
    model.load_seconds = time.perf_counter() - t0
    return model


def _load(path: str | os.PathLike | None, use_image: bool, t0: float) -> Model:
    blas_threads()  # its first look at the machine's free cores spans the load
    path = resolve_model(path)
    if use_image and os.path.isfile(path):
        cached = read_image(path)
        if cached is not None:
            arrays, info = cached
            try:
                return _build(info, arrays, path, os.path.getsize(path), t0, from_image=True)
            except Exception:
                pass  # an image that does not build is rebuilt from the GGUF, never trusted
    try:
        from .gguf_loader import open_gguf
        gf = open_gguf(path)
        facts, tk = _tokenizer_info(gf)
        info = {"name": gf.name, "arch": gf.arch, "quant": gf.quant, "config": gf.config.__dict__,
                "tied_output": gf.tied_output, **facts}
        if use_image:
            info["tokenizer_json"] = tk.to_str()
        arrays = _image_arrays(gf, info) if use_image else None
        if arrays is None:
            arrays = dict(_weight_arrays(gf))
    except ModelLoadError:
        raise
    except MemoryError as e:
        raise ModelLoadError(f"{path}: too large to load into memory") from e
    except Exception as e:  # a hostile file must only ever give a ModelLoadError
        raise ModelLoadError(f"{path}: broken GGUF file ({type(e).__name__}: {e})") from e
    return _build(info, arrays, path, os.path.getsize(path), t0, from_image=False, tk=tk)
