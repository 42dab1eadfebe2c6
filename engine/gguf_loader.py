"""Read, validate and dequantize a llama-family GGUF file."""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, LlamaFileType
from gguf.quants import dequantize

from .config import ModelConfig
from .errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_VERSIONS = (2, 3)
GGUF_MAGIC = b"GGUF"
# Beyond these the file is not a model this engine can hold in memory.
MAX_TENSORS = 100_000
MAX_DIM = 1 << 24
MAX_NAME = 1 << 16      # bytes of a metadata key or tensor name
MAX_TENSOR_DIMS = 4     # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 2
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


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
    _scan_header(path, size, n_tensors, n_kv)
    return size


class _HeaderScan:
    """Walks a GGUF header with bounds checks, so that GGUFReader never sees a length,
    count or offset that points past the end of the file (it would allocate or loop on it)."""

    def __init__(self, path: str, buf, size: int):
        self.path, self.buf, self.size, self.pos = path, buf, size, 24

    def fail(self, message: str):
        raise ModelLoadError(f"{self.path}: {message}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            self.fail(f"{what} at byte {self.pos} needs {n} bytes and runs past the end of the "
                      f"file ({self.size} bytes): the file is truncated or corrupt")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self, what: str, limit: int | None = None, read: bool = False) -> str | None:
        n = self.unpack("<Q", f"length of {what}")
        if limit is not None and n > limit:
            self.fail(f"{what} has an absurd string length {n} (limit {limit})")
        self.need(n, f"{what} (string length {n})")
        raw = bytes(self.buf[self.pos:self.pos + n]) if read else None
        self.pos += n
        if raw is None:
            return None
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not valid UTF-8: {raw[:40]!r}")

    def value(self, vtype: int, what: str, depth: int = 0) -> None:
        if vtype in _SCALAR_SIZES:
            self.need(_SCALAR_SIZES[vtype], what)
            self.pos += _SCALAR_SIZES[vtype]
        elif vtype == _STRING:
            self.string(what)
        elif vtype == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                self.fail(f"{what}: arrays nested too deeply")
            etype = self.unpack("<I", f"element type of {what}")
            count = self.unpack("<Q", f"element count of {what}")
            left = self.size - self.pos
            if etype in _SCALAR_SIZES:
                if count * _SCALAR_SIZES[etype] > left:
                    self.fail(f"{what}: array of {count} items needs {count * _SCALAR_SIZES[etype]} "
                              f"bytes, past the end of the file ({self.size} bytes)")
                self.pos += count * _SCALAR_SIZES[etype]
                return
            min_item = 8 if etype == _STRING else 12
            if etype not in (_STRING, _ARRAY):
                self.fail(f"{what}: unknown array element type {etype}")
            if count * min_item > left:
                self.fail(f"{what}: absurd array length {count} for the {left} bytes left in the file")
            for i in range(count):
                self.value(etype, f"{what}[{i}]", depth + 1)
        else:
            self.fail(f"{what}: unknown value type {vtype}")

    def run(self, n_tensors: int, n_kv: int) -> None:
        alignment, keys = 32, set()
        for i in range(n_kv):
            key = self.string(f"metadata key #{i}", limit=MAX_NAME, read=True)
            if key in keys:
                self.fail(f"duplicate metadata key '{key}'")
            keys.add(key)
            vtype = self.unpack("<I", f"value type of metadata '{key}'")
            if key == "general.alignment":
                if vtype != 4:
                    self.fail(f"metadata 'general.alignment' has type {vtype}, expected uint32 (4)")
                alignment = self.unpack("<I", "general.alignment")
                if alignment == 0 or alignment & (alignment - 1):
                    self.fail(f"general.alignment = {alignment} is not a power of two")
                continue
            self.value(vtype, f"metadata '{key}'")
        if n_tensors * 33 > self.size - self.pos:  # a tensor info takes at least 33 bytes
            self.fail(f"absurd tensor count {n_tensors} for a {self.size}-byte file")
        infos, names = [], set()
        for i in range(n_tensors):
            name = self.string(f"name of tensor #{i}", limit=MAX_NAME, read=True)
            if not name:
                self.fail(f"tensor #{i} has an empty name")
            if name in names:
                self.fail(f"duplicate tensor '{name}'")
            names.add(name)
            n_dims = self.unpack("<I", f"dimension count of tensor '{name}'")
            if not 1 <= n_dims <= MAX_TENSOR_DIMS:
                self.fail(f"tensor '{name}' has {n_dims} dimensions (expected 1..{MAX_TENSOR_DIMS})")
            dims = [self.unpack("<Q", f"shape of tensor '{name}'") for _ in range(n_dims)]
            ttype = self.unpack("<I", f"type of tensor '{name}'")
            offset = self.unpack("<Q", f"data offset of tensor '{name}'")
            try:
                qtype = GGMLQuantizationType(ttype)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                self.fail(f"tensor '{name}' has an unknown type {ttype}")
            if dims[0] % block:
                self.fail(f"tensor '{name}' has rows of {dims[0]} values, not a multiple of "
                          f"{qtype.name}'s block of {block}")
            n_bytes = math.prod(dims) // block * type_size
            if offset % alignment:
                self.fail(f"tensor '{name}' data offset {offset} is not aligned to {alignment}")
            infos.append((offset, n_bytes, name, dims, qtype.name))
        data_start = -(-self.pos // alignment) * alignment
        spans = []
        for offset, n_bytes, name, dims, tname in infos:
            end = data_start + offset + n_bytes
            if end > self.size:
                self.fail(f"tensor '{name}' ({tname}, shape {dims}) needs {n_bytes} bytes at byte "
                          f"{data_start + offset}, past the end of the file ({self.size} bytes)")
            spans.append((offset, offset + n_bytes, name))
        spans.sort()
        for (_s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:], strict=False):
            if s1 < e0:
                self.fail(f"tensors '{n0}' and '{n1}' overlap in the file")


def _scan_header(path: str, size: int, n_tensors: int, n_kv: int) -> None:
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        _HeaderScan(path, buf, size).run(n_tensors, n_kv)


def _require(meta: dict, key: str, path: str, kind=int):
    value = meta.get(key)
    if value is None:
        raise ModelLoadError(f"{path}: missing metadata key '{key}'")
    try:
        return kind(value)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: metadata '{key}' = {value!r} is not a {kind.__name__}") from e


def _optional(meta: dict, key: str, path: str, default, kind):
    return _require(meta, key, path, kind) if key in meta else kind(default)


def _config_from_metadata(meta: dict, arch: str, path: str) -> ModelConfig:
    n_heads = _require(meta, f"{arch}.attention.head_count", path)
    d_model = _require(meta, f"{arch}.embedding_length", path)
    cfg = ModelConfig(
        n_layers=_require(meta, f"{arch}.block_count", path),
        d_model=d_model,
        n_ff=_require(meta, f"{arch}.feed_forward_length", path),
        n_heads=n_heads,
        n_kv_heads=_optional(meta, f"{arch}.attention.head_count_kv", path, n_heads, int),
        head_dim=d_model // n_heads if n_heads > 0 else 0,
        vocab_size=0,  # set from the embedding tensor
        context_length=_optional(meta, f"{arch}.context_length", path, 2048, int),
        rope_base=_optional(meta, f"{arch}.rope.freq_base", path, 10000.0, float),
        norm_eps=_optional(meta, f"{arch}.attention.layer_norm_rms_epsilon", path, 1e-5, float),
    )
    if not (math.isfinite(cfg.rope_base) and cfg.rope_base > 1.0):
        raise ModelLoadError(f"{path}: {arch}.rope.freq_base = {cfg.rope_base} is not a finite number > 1")
    if not (math.isfinite(cfg.norm_eps) and 0.0 <= cfg.norm_eps < 1.0):
        raise ModelLoadError(
            f"{path}: {arch}.attention.layer_norm_rms_epsilon = {cfg.norm_eps} is not in [0, 1)")
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
        big = ("tokens", "merges", "token_type", "scores")
        if key.startswith("tokenizer.ggml.") and key.split(".")[-1] in big:
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
    if not 0 < vocab <= MAX_DIM:
        raise ModelLoadError(f"{path}: tensor 'token_embd.weight' has shape "
                             f"{tuple(reversed([int(x) for x in embd.shape]))}, "
                             f"expected (vocab, {cfg.d_model})")
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
            raise ModelLoadError(
                f"{path}: tensor '{name}' data ends at byte {end}, past the end of the file ({size})")
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
    for (_s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:], strict=False):
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
