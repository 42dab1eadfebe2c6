"""Validate a GGUF model file and dequantize its tensors."""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from .config import SUPPORTED_ARCHITECTURES, ModelConfig, config_from_metadata
from .errors import ModelLoadError
from .gguf_header import GGUFHeader, TensorInfo, read_header

__all__ = ["SUPPORTED_ARCHITECTURES", "GGUFFile", "open_gguf", "expected_shapes", "quant_mix",
           "read_string_array", "read_int_array", "read_float_array"]

MAX_DIM = 1 << 24
Q = GGMLQuantizationType
# Types stored as plain NumPy items (the rest are blocks of bytes that `dequantize` unpacks).
_PLAIN = {Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64, Q.I8: np.int8,
          Q.I16: np.int16, Q.I32: np.int32, Q.I64: np.int64}


@dataclass
class GGUFFile:
    """Validated metadata and tensor infos of one GGUF file."""

    path: str
    header: GGUFHeader = field(repr=False)
    arch: str
    name: str
    quant: str
    config: ModelConfig
    tied_output: bool

    @property
    def metadata(self) -> dict:
        return self.header.metadata

    @property
    def header_bytes(self) -> int:
        return self.header.header_bytes

    def tensor(self, name: str) -> np.ndarray:
        """Dequantize one tensor to float32 in NumPy order (out, in)."""
        t = self.header.tensors[name]
        plain = _PLAIN.get(t.qtype)
        if plain is not None:
            raw = np.fromfile(self.path, dtype=plain, count=t.n_bytes // np.dtype(plain).itemsize,
                              offset=t.offset).reshape(t.shape)
        else:
            raw = np.fromfile(self.path, dtype=np.uint8, count=t.n_bytes, offset=t.offset)
            raw = raw.reshape(quant_shape_to_byte_shape(t.shape, t.qtype))
        try:
            arr = dequantize(raw, t.qtype)
        except NotImplementedError as e:
            raise ModelLoadError(
                f"{self.path}: tensor '{name}' has type {t.qtype.name}, "
                f"which this engine cannot dequantize ({e})"
            ) from e
        return np.asarray(arr, dtype=np.float32).reshape(t.shape)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """NumPy-order shape of every required tensor (out, in)."""
    d, q, kv, ff, hd = cfg.d_model, cfg.q_dim, cfg.kv_dim, cfg.n_ff, cfg.head_dim
    shapes = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    per_layer = {
        "attn_norm.weight": (d,), "attn_q.weight": (q, d), "attn_k.weight": (kv, d),
        "attn_v.weight": (kv, d), "attn_output.weight": (d, q), "ffn_norm.weight": (d,),
        "ffn_gate.weight": (ff, d), "ffn_up.weight": (ff, d), "ffn_down.weight": (d, ff),
    }
    if cfg.qkv_bias:
        per_layer.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
    if cfg.qk_norm:
        per_layer.update({"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)})
    if cfg.post_norms:
        per_layer.update({"post_attention_norm.weight": (d,), "post_ffw_norm.weight": (d,)})
    for i in range(cfg.n_layers):
        for name, shape in per_layer.items():
            shapes[f"blk.{i}.{name}"] = shape
    return shapes


def quant_mix(tensors) -> str:
    """Tensor count per storage type, quantized types first: 'Q4_K x27, Q5_0 x81, ..., F32 x109'."""
    counts = Counter(t.qtype.name for t in tensors)
    order = sorted(counts, key=lambda k: (k.startswith(("F", "BF")), k))
    return ", ".join(f"{k} x{counts[k]}" for k in order)


def _quant_name(meta: dict, tensors: dict[str, TensorInfo]) -> str:
    ftype = meta.get("general.file_type")
    if isinstance(ftype, int) and not isinstance(ftype, bool):
        try:
            return LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_")
        except ValueError:
            pass
    counts = Counter(t.qtype.name for t in tensors.values() if len(t.dims) > 1)
    return counts.most_common(1)[0][0] if counts else "unknown"


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open and validate a GGUF file; raise ModelLoadError naming the problem."""
    path = os.fspath(path)
    header = read_header(path)
    meta, tensors = header.metadata, header.tensors
    arch = meta.get("general.architecture")
    if arch is None:
        raise ModelLoadError(f"{path}: missing metadata key 'general.architecture'")
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture '{arch}'; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    cfg = config_from_metadata(meta, arch, path, qkv_bias="blk.0.attn_q.bias" in tensors)
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ModelLoadError(f"{path}: missing tensor 'token_embd.weight'")
    vocab = int(embd.dims[-1]) if len(embd.dims) == 2 else 0
    if not 0 < vocab <= MAX_DIM:
        raise ModelLoadError(f"{path}: tensor 'token_embd.weight' has shape {embd.shape}, "
                             f"expected (vocab, {cfg.d_model})")
    cfg = ModelConfig(**{**cfg.__dict__, "vocab_size": vocab})
    blocks = len({n.split(".", 2)[1] for n in tensors if n.startswith("blk.")})
    if cfg.n_layers > blocks:  # checked before listing every block's tensors: 2**24 of them took 19 GB
        raise ModelLoadError(f"{path}: {arch}.block_count = {cfg.n_layers}, but the file holds "
                             f"tensors for {blocks} blocks")
    shapes = expected_shapes(cfg)
    tied = "output.weight" not in tensors
    if not tied:
        shapes["output.weight"] = (cfg.vocab_size, cfg.d_model)
    if "rope_freqs.weight" in tensors:  # Llama 3.1+ scales RoPE frequencies by these divisors
        shapes["rope_freqs.weight"] = (cfg.head_dim // 2,)
    for name, shape in shapes.items():
        t = tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{path}: missing tensor '{name}' (expected shape {shape})")
        if t.shape != shape:
            raise ModelLoadError(f"{path}: tensor '{name}' has shape {t.shape}, expected {shape}")
    return GGUFFile(
        path=path, header=header, arch=arch, name=display_name(meta, path),
        quant=_quant_name(meta, tensors), config=cfg, tied_output=tied,
    )


# A quantization tag at the end of a file name: "SmolLM2-135M-Instruct.Q4_1", "gemma-3-270m-it-Q4_K_M".
_QUANT_TAG = re.compile(r"[.\-_](?:i?q\d\w*|f16|f32|bf16)$", re.IGNORECASE)


def _words(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def display_name(meta: dict, path: str) -> str:
    """The model's name for people: `general.name`, unless it is a build string.

    Converters fill `general.name` from the checkpoint's folder, so it can carry a training run's
    tag ("Smollm2 135M 8k Lc100K Mix1 Ep2": its `general.finetune` with digits in it). Then the
    file's own name says more ("SmolLM2-135M-Instruct"), less its quantization tag.
    """
    stem = _QUANT_TAG.sub("", os.path.splitext(os.path.basename(path))[0]) or os.path.basename(path)
    name = meta.get("general.name")
    if not isinstance(name, str) or not name.strip():
        return stem
    finetune = meta.get("general.finetune")
    tag = _words(finetune) if isinstance(finetune, str) else ""
    if tag and any(c.isdigit() for c in tag) and tag in _words(name):
        return stem
    return name.strip()


def _array(gf: GGUFFile, key: str, kinds: tuple[str, ...]):
    value = gf.metadata.get(key)
    if value is None:
        return None
    if isinstance(value, np.ndarray) and value.dtype.kind in kinds:
        return value
    raise ModelLoadError(f"{gf.path}: metadata '{key}' is not an array of the expected type")


def read_string_array(gf: GGUFFile, key: str) -> list[str] | None:
    """A metadata array of strings (tokens, merges), or None when absent."""
    value = gf.metadata.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ModelLoadError(f"{gf.path}: metadata '{key}' is not an array of strings")
    return value


def read_int_array(gf: GGUFFile, key: str) -> np.ndarray | None:
    """A metadata array of integers (token types), or None when absent."""
    return _array(gf, key, ("i", "u"))


def read_float_array(gf: GGUFFile, key: str) -> np.ndarray | None:
    """A metadata array of numbers (token scores) as float32, or None when absent."""
    value = _array(gf, key, ("f", "i", "u"))
    return None if value is None else value.astype(np.float32)
