"""Parse a GGUF header with bounds checks: metadata values and tensor infos, never past the file.

Every length, count and offset is checked against the file size before it is used, so a
hostile file cannot make the parser allocate or loop on a number it claims. Arrays of
scalars become NumPy arrays in one read (a 262,144-token vocabulary parses in well under a
second, where gguf's GGUFReader takes ~20 s building one field object per item).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import ModelLoadError

SUPPORTED_VERSIONS = (2, 3)
GGUF_MAGIC = b"GGUF"
# Beyond these the file is not a model this engine can hold in memory.
MAX_TENSORS = 100_000
MAX_NAME = 1 << 16      # bytes of a metadata key or tensor name
MAX_TENSOR_DIMS = 4     # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 2
MAX_STRING_ITEMS = 1 << 24  # strings in one array (each a Python object): a vocabulary is < 1M
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
            10: "<u8", 11: "<i8", 12: "<f8"}
_BOOL, _STRING, _ARRAY = 7, 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies: name, GGUF dims (fastest first), type, absolute offset, size."""

    name: str
    dims: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """NumPy order (slowest first)."""
        return tuple(reversed(self.dims))


@dataclass
class GGUFHeader:
    """Metadata values and tensor infos of one GGUF file."""

    metadata: dict = field(repr=False)
    types: dict[str, tuple[int, int | None]] = field(repr=False)  # key -> (value type, array element type)
    tensors: dict[str, TensorInfo] = field(repr=False)
    header_bytes: int = 0


class _HeaderScan:
    """Walks a GGUF header with bounds checks, reading every value."""

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

    def string(self, what: str, limit: int | None = None, strict: bool = True) -> str:
        n = self.unpack("<Q", f"length of {what}")
        if limit is not None and n > limit:
            self.fail(f"{what} has an absurd string length {n} (limit {limit})")
        self.need(n, f"{what} (string length {n})")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            if strict:
                self.fail(f"{what} is not valid UTF-8: {raw[:40]!r}")
            return raw.decode("utf-8", errors="replace")  # llama.cpp keeps such token bytes too

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALARS:
            n = np.dtype(_SCALARS[vtype]).itemsize
            self.need(n, what)
            v = np.frombuffer(self.buf, _SCALARS[vtype], 1, self.pos)[0]
            self.pos += n
            return bool(v) if vtype == _BOOL else v.item()
        if vtype == _STRING:
            return self.string(what, strict=False)
        if vtype == _ARRAY:
            return self.array(what, depth)
        self.fail(f"{what}: unknown value type {vtype}")

    def array(self, what: str, depth: int):
        if depth >= MAX_ARRAY_DEPTH:
            self.fail(f"{what}: arrays nested too deeply")
        etype = self.unpack("<I", f"element type of {what}")
        count = self.unpack("<Q", f"element count of {what}")
        left = self.size - self.pos
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype])
            if count * dtype.itemsize > left:
                self.fail(f"{what}: array of {count} items needs {count * dtype.itemsize} "
                          f"bytes, past the end of the file ({self.size} bytes)")
            arr = np.frombuffer(self.buf, dtype, count, self.pos).copy()
            self.pos += count * dtype.itemsize
            return arr.astype(bool) if etype == _BOOL else arr
        if etype not in (_STRING, _ARRAY):
            self.fail(f"{what}: unknown array element type {etype}")
        min_item = 8 if etype == _STRING else 12
        if count * min_item > left or (etype == _STRING and count > MAX_STRING_ITEMS):
            self.fail(f"{what}: absurd array length {count} for the {left} bytes left in the file "
                      f"(at most {MAX_STRING_ITEMS} strings)")
        if etype == _STRING:
            return [self.string(f"{what}[{i}]", strict=False) for i in range(count)]
        return [self.array(f"{what}[{i}]", depth + 1) for i in range(count)]

    def run(self, n_tensors: int, n_kv: int) -> GGUFHeader:
        alignment, meta, types = 32, {}, {}
        for i in range(n_kv):
            key = self.string(f"metadata key #{i}", limit=MAX_NAME)
            if key in meta:
                self.fail(f"duplicate metadata key '{key}'")
            vtype = self.unpack("<I", f"value type of metadata '{key}'")
            etype = None
            if vtype == _ARRAY and self.size - self.pos >= 4:
                etype = struct.unpack_from("<I", self.buf, self.pos)[0]
            if key == "general.alignment":
                if vtype != 4:
                    self.fail(f"metadata 'general.alignment' has type {vtype}, expected uint32 (4)")
                alignment = self.unpack("<I", "general.alignment")
                if alignment == 0 or alignment & (alignment - 1):
                    self.fail(f"general.alignment = {alignment} is not a power of two")
                meta[key], types[key] = alignment, (vtype, None)
                continue
            meta[key] = self.value(vtype, f"metadata '{key}'")
            types[key] = (vtype, etype)
        if n_tensors * 33 > self.size - self.pos:  # a tensor info takes at least 33 bytes
            self.fail(f"absurd tensor count {n_tensors} for a {self.size}-byte file")
        infos: list[tuple[str, list[int], GGMLQuantizationType, int, int]] = []
        names: set[str] = set()
        for i in range(n_tensors):
            name = self.string(f"name of tensor #{i}", limit=MAX_NAME)
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
            if offset % alignment:
                self.fail(f"tensor '{name}' data offset {offset} is not aligned to {alignment}")
            infos.append((name, dims, qtype, offset, math.prod(dims) // block * type_size))
        data_start = -(-self.pos // alignment) * alignment
        tensors = {}
        for name, dims, qtype, offset, n_bytes in infos:
            if data_start + offset + n_bytes > self.size:
                self.fail(f"tensor '{name}' ({qtype.name}, shape {dims}) needs {n_bytes} bytes at "
                          f"byte {data_start + offset}, past the end of the file ({self.size} bytes)")
            tensors[name] = TensorInfo(name, tuple(dims), qtype, data_start + offset, n_bytes)
        spans = sorted((t.offset, t.offset + t.n_bytes, t.name) for t in tensors.values())
        for (_s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:], strict=False):
            if s1 < e0:
                self.fail(f"tensors '{n0}' and '{n1}' overlap in the file")
        header_bytes = min((t.offset for t in tensors.values()), default=self.size)
        return GGUFHeader(metadata=meta, types=types, tensors=tensors, header_bytes=header_bytes)


def read_header(path: str) -> GGUFHeader:
    """Check the fixed header, then parse all metadata and tensor infos; ModelLoadError names any problem."""
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
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _HeaderScan(path, buf, size).run(n_tensors, n_kv)
