"""Read, validate and dequantize a llama-family GGUF file."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, LlamaFileType
from gguf.quants import dequantize

from .config import ModelConfig
from .errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_VERSIONS = (2, 3)
GGUF_MAGIC = b"GGUF"
LAYER_TENSORS = (
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
    "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
)
# Beyond these the file is not a model this engine can hold in memory.
MAX_TENSORS = 100_000
MAX_DIM = 1 << 24


@dataclass
class GGUFFile:
    """Validated metadata and tensor handles of one GGUF file."""

    path: str
    reader: GGUFReader
    arch: str
    name: str
    quant: str
    config: ModelConfig
    metadata: dict = field(repr=False)
    tied_output: bool
    header_bytes: int

    def tensor(self, name: str) -> np.ndarray:
        """Dequantize one tensor to float32 in NumPy order (out, in)."""
        t = self.reader.get_tensor(self._index[name])
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(
                f"{self.path}: tensor '{name}' has type {t.tensor_type.name}, "
                f"which this engine cannot dequantize ({e})"
            ) from e
        return np.asarray(arr, dtype=np.float32).reshape(tuple(reversed([int(x) for x in t.shape])))

    @property
    def _index(self) -> dict[str, int]:
        return {t.name: i for i, t in enumerate(self.reader.tensors)}


def _field_value(reader: GGUFReader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    if f.types and f.types[0] == GGUFValueType.ARRAY:
        return f.contents()
    return f.contents()


def _check_header(path: str) -> int:
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: not a regular file")
    size = os.path.getsize(path)
    if size == 0:
        raise ModelLoadError(f"{path}: the file is empty")
    with open(path, "rb") as fh:
        head = fh.read(24)
    if head[:4] != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
    if len(head) < 24:
        raise ModelLoadError(f"{path}: truncated header ({size} bytes)")
    version = int.from_bytes(head[4:8], "little")
    if version not in SUPPORTED_VERSIONS:
        raise ModelLoadError(f"{path}: unsupported GGUF version {version}; supported: 2, 3")
    n_tensors = int.from_bytes(head[8:16], "little")
    n_kv = int.from_bytes(head[16:24], "little")
    if n_tensors > MAX_TENSORS:
        raise ModelLoadError(f"{path}: absurd tensor count {n_tensors} (limit {MAX_TENSORS})")
    # Every key/value pair takes at least 12 bytes, so the count cannot exceed the size.
    if n_kv > size // 12:
        raise ModelLoadError(f"{path}: absurd metadata key count {n_kv} for a {size}-byte file")
    return size


def _require(meta: dict, key: str, path: str, kind=int):
    value = meta.get(key)
    if value is None:
        raise ModelLoadError(f"{path}: missing metadata key '{key}'")
    try:
        return kind(value)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: metadata '{key}' = {value!r} is not a {kind.__name__}") from e


def _config_from_metadata(meta: dict, arch: str, path: str) -> ModelConfig:
    n_heads = _require(meta, f"{arch}.attention.head_count", path)
    d_model = _require(meta, f"{arch}.embedding_length", path)
    n_kv = meta.get(f"{arch}.attention.head_count_kv", n_heads)
    cfg = ModelConfig(
        n_layers=_require(meta, f"{arch}.block_count", path),
        d_model=d_model,
        n_ff=_require(meta, f"{arch}.feed_forward_length", path),
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        head_dim=d_model // n_heads if n_heads > 0 else 0,
        vocab_size=0,  # set from the embedding tensor
        context_length=int(meta.get(f"{arch}.context_length", 2048)),
        rope_base=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
    )
    for name in ("n_layers", "d_model", "n_ff", "n_heads", "n_kv_heads", "context_length"):
        v = getattr(cfg, name)
        if not 0 < v <= MAX_DIM:
            raise ModelLoadError(f"{path}: {name} = {v} is out of range (1..{MAX_DIM})")
    if cfg.d_model % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
        raise ModelLoadError(
            f"{path}: embedding_length {cfg.d_model}, head_count {cfg.n_heads} and "
            f"head_count_kv {cfg.n_kv_heads} do not divide evenly"
        )
    if cfg.head_dim % 2:
        raise ModelLoadError(f"{path}: head dimension {cfg.head_dim} must be even for RoPE")
    return cfg


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """NumPy-order shape of every required tensor (out, in)."""
    d, kv, ff = cfg.d_model, cfg.kv_dim, cfg.n_ff
    shapes = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    per_layer = {
        "attn_norm": (d,), "attn_q": (d, d), "attn_k": (kv, d), "attn_v": (kv, d),
        "attn_output": (d, d), "ffn_norm": (d,), "ffn_gate": (ff, d), "ffn_up": (ff, d),
        "ffn_down": (d, ff),
    }
    for i in range(cfg.n_layers):
        for name, shape in per_layer.items():
            shapes[f"blk.{i}.{name}.weight"] = shape
    return shapes


def _quant_name(meta: dict, reader: GGUFReader) -> str:
    ftype = meta.get("general.file_type")
    if ftype is not None:
        try:
            return LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_")
        except ValueError:
            pass
    counts = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1)
    return counts.most_common(1)[0][0] if counts else "unknown"


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open and validate a GGUF file; raise ModelLoadError naming the problem."""
    path = os.fspath(path)
    size = _check_header(path)
    try:
        reader = GGUFReader(path, "r")
    except ModelLoadError:
        raise
    except Exception as e:  # gguf raises ValueError, IndexError, struct errors...
        raise ModelLoadError(f"{path}: broken GGUF file ({type(e).__name__}: {e})") from e
    meta = {}
    for key in reader.fields:
        if key.startswith("tokenizer.ggml.") and key.split(".")[-1] in ("tokens", "merges", "token_type", "scores"):
            continue  # large arrays: read on demand by the tokenizer
        try:
            meta[key] = _field_value(reader, key)
        except Exception as e:
            raise ModelLoadError(f"{path}: metadata '{key}' is unreadable ({e})") from e
    arch = meta.get("general.architecture")
    if arch is None:
        raise ModelLoadError(f"{path}: missing metadata key 'general.architecture'")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture '{arch}'; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    cfg = _config_from_metadata(meta, arch, path)
    tensors = {t.name: t for t in reader.tensors}
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ModelLoadError(f"{path}: missing tensor 'token_embd.weight'")
    vocab = int(embd.shape[-1]) if len(embd.shape) == 2 else 0
    cfg = ModelConfig(**{**cfg.__dict__, "vocab_size": vocab})
    shapes = expected_shapes(cfg)
    tied = "output.weight" not in tensors
    if not tied:
        shapes["output.weight"] = (cfg.vocab_size, cfg.d_model)
    for name, shape in shapes.items():
        t = tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{path}: missing tensor '{name}' (expected shape {shape})")
        got = tuple(reversed([int(x) for x in t.shape]))
        if got != shape:
            raise ModelLoadError(f"{path}: tensor '{name}' has shape {got}, expected {shape}")
        if t.tensor_type not in GGMLQuantizationType:
            raise ModelLoadError(f"{path}: tensor '{name}' has an unknown type {t.tensor_type}")
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ModelLoadError(f"{path}: tensor '{name}' data ends at byte {end}, past the end of the file ({size})")
    _check_overlaps(path, [tensors[n] for n in shapes])
    header_bytes = min(int(t.data_offset) for t in reader.tensors) if reader.tensors else size
    return GGUFFile(
        path=path, reader=reader, arch=arch,
        name=str(meta.get("general.name") or os.path.splitext(os.path.basename(path))[0]),
        quant=_quant_name(meta, reader), config=cfg, metadata=meta,
        tied_output=tied, header_bytes=header_bytes,
    )


def _check_overlaps(path: str, tensors) -> None:
    spans = sorted((int(t.data_offset), int(t.data_offset) + int(t.n_bytes), t.name) for t in tensors)
    for (s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ModelLoadError(f"{path}: tensors '{n0}' and '{n1}' overlap in the file")


def read_string_array(gf: GGUFFile, key: str) -> list[str] | None:
    """A metadata array of strings (tokens, merges), or None when absent."""
    f = gf.reader.fields.get(key)
    if f is None:
        return None
    return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]


def read_int_array(gf: GGUFFile, key: str) -> np.ndarray | None:
    """A metadata array of integers (token types), or None when absent."""
    f = gf.reader.fields.get(key)
    if f is None:
        return None
    return np.array([int(f.parts[i][0]) for i in f.data], dtype=np.int64)
