"""A tiny llama GGUF for tests, a map of its header bytes, and a naive reference forward.

`write_tiny_gguf` writes a 2-layer llama (d_model 64, 4 query heads, 2 KV heads,
ffn 64) with a byte-level BPE vocabulary and seeded random weights, partly
quantized (Q8_0, Q4_1). `gguf_layout` maps where every header field lies, so
hostile variants can be made by patching bytes. `reference_logits` is a
textbook forward pass written independently of engine/model.py.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, LlamaFileType
from gguf.quants import dequantize, quantize

Q = GGMLQuantizationType

N_LAYERS, D_MODEL, N_HEADS, N_KV_HEADS, N_FF = 2, 64, 4, 2, 64
HEAD_DIM = D_MODEL // N_HEADS
CONTEXT = 512
ROPE_BASE = 10000.0
NORM_EPS = 1e-5

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Merges over GPT-2's byte alphabet ('Ġ' is the space byte).
MERGES = ["h e", "Ġ t", "Ġt he", "l l", "i n", "Ġ a", "e r", "o u", "Ġ s", "Ġ w"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


def byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode: the printable stand-in of each of the 256 bytes."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """Tokens (specials, 256 bytes, merge results), merges, and llama.cpp token types."""
    tokens = SPECIALS + byte_alphabet()
    for m in MERGES:
        a, b = m.split(" ")
        tokens.append(a + b)
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))  # 3 CONTROL, 1 NORMAL
    return tokens, list(MERGES), types


def tiny_tensors(seed: int = 0, tied: bool = True) -> dict[str, tuple[np.ndarray, GGMLQuantizationType]]:
    """Float32 weights in NumPy order (out, in) and the type each is stored as."""
    rng = np.random.default_rng(seed)
    vocab = len(tiny_vocab()[0])
    d, kv, ff = D_MODEL, N_KV_HEADS * HEAD_DIM, N_FF

    def mat(rows, cols, scale=1.0):
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    def norm():
        return (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)

    out = {"token_embd.weight": ((0.5 * rng.standard_normal((vocab, d))).astype(np.float32), Q.Q8_0)}
    for i in range(N_LAYERS):
        qt = Q.Q4_1 if i == 0 else Q.Q8_0
        out[f"blk.{i}.attn_norm.weight"] = (norm(), Q.F32)
        out[f"blk.{i}.attn_q.weight"] = (mat(d, d, 2.0), qt)
        out[f"blk.{i}.attn_k.weight"] = (mat(kv, d, 2.0), qt)
        out[f"blk.{i}.attn_v.weight"] = (mat(kv, d), qt)
        out[f"blk.{i}.attn_output.weight"] = (mat(d, d), Q.F32 if i == 0 else qt)
        out[f"blk.{i}.ffn_norm.weight"] = (norm(), Q.F32)
        out[f"blk.{i}.ffn_gate.weight"] = (mat(ff, d), qt)
        out[f"blk.{i}.ffn_up.weight"] = (mat(ff, d), qt)
        out[f"blk.{i}.ffn_down.weight"] = (mat(d, ff), Q.F32 if i == 0 else qt)
    out["output_norm.weight"] = (norm(), Q.F32)
    if not tied:
        out["output.weight"] = (mat(vocab, d, 4.0), Q.F32)
    return out


def write_tiny_gguf(path, *, tied: bool = True, seed: int = 0, arch: str = "llama",
                    chat_template: str | None = CHATML_TEMPLATE, drop: tuple[str, ...] = (),
                    replace: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
                    metadata: dict | None = None, file_type: int | None = LlamaFileType.MOSTLY_Q4_1,
                    tokenizer: bool = True) -> str:
    """Write the tiny model; `drop`/`replace` remove or swap tensors, `metadata` adds keys."""
    path = os.fspath(path)
    w = GGUFWriter(path, arch)
    w.add_name("tiny-llama")
    if file_type is not None:
        w.add_uint32("general.file_type", int(file_type))
    w.add_uint32(f"{arch}.context_length", CONTEXT)
    w.add_uint32(f"{arch}.embedding_length", D_MODEL)
    w.add_uint32(f"{arch}.block_count", N_LAYERS)
    w.add_uint32(f"{arch}.feed_forward_length", N_FF)
    w.add_uint32(f"{arch}.rope.dimension_count", HEAD_DIM)
    w.add_uint32(f"{arch}.attention.head_count", N_HEADS)
    w.add_uint32(f"{arch}.attention.head_count_kv", N_KV_HEADS)
    w.add_float32(f"{arch}.rope.freq_base", ROPE_BASE)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", NORM_EPS)
    if tokenizer:
        tokens, merges, types = tiny_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, int(value))
    tensors = tiny_tensors(seed, tied)
    tensors.update(replace or {})
    for name, (arr, qtype) in tensors.items():
        if name in drop:
            continue
        if arr.dtype == np.uint8:  # already raw bytes of `qtype`
            w.add_tensor(name, arr, raw_dtype=qtype)
        elif qtype == Q.F32:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        else:
            w.add_tensor(name, quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- where the header's fields lie (an independent GGUF header walker) -------------------

_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


@dataclass
class KVSpan:
    key: str
    at: int                 # start of the key's length field
    type_at: int            # the value type (u32)
    value_at: int           # the value (for a string: its length field)
    elem_type_at: int = -1  # arrays: element type (u32)
    count_at: int = -1      # arrays: element count (u64)
    end: int = 0


@dataclass
class TensorSpan:
    name: str
    at: int
    n_dims_at: int
    dims_at: list[int]
    type_at: int
    offset_at: int
    offset: int             # relative to the data section
    n_bytes: int


@dataclass
class Layout:
    size: int
    kvs: dict[str, KVSpan] = field(default_factory=dict)
    tensors: dict[str, TensorSpan] = field(default_factory=dict)
    tensor_info_at: int = 0
    data_start: int = 0


def gguf_layout(data: bytes) -> Layout:
    """Byte offsets of every metadata key and tensor-info field of a well-formed GGUF."""
    from gguf.constants import GGML_QUANT_SIZES

    lay = Layout(size=len(data))
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string(p):
        (n,) = struct.unpack_from("<Q", data, p)
        return data[p + 8:p + 8 + n].decode("utf-8"), p + 8 + n

    def value(p, vtype):
        if vtype == STRING:
            return string(p)[1]
        if vtype == ARRAY:
            etype, count = struct.unpack_from("<IQ", data, p)
            p += 12
            for _ in range(count):
                p = value(p, etype)
            return p
        return p + struct.calcsize("<" + _SCALAR[vtype])

    for _ in range(n_kv):
        at = pos
        key, pos = string(pos)
        (vtype,) = struct.unpack_from("<I", data, pos)
        span = KVSpan(key=key, at=at, type_at=pos, value_at=pos + 4)
        if vtype == ARRAY:
            span.elem_type_at, span.count_at = pos + 4, pos + 8
        pos = value(pos + 4, vtype)
        span.end = pos
        lay.kvs[key] = span
    lay.tensor_info_at = pos
    for _ in range(n_tensors):
        at = pos
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", data, pos)
        dims_at = [pos + 4 + 8 * i for i in range(n_dims)]
        dims = struct.unpack_from(f"<{n_dims}Q", data, pos + 4)
        pos += 4 + 8 * n_dims
        ttype, offset = struct.unpack_from("<IQ", data, pos)
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        n_bytes = int(np.prod(dims)) // block * type_size
        lay.tensors[name] = TensorSpan(name, at, at + 8 + len(name.encode()), dims_at, pos,
                                       pos + 4, offset, n_bytes)
        pos += 12
    lay.data_start = -(-pos // 32) * 32
    return lay


def patch(data: bytes, *edits: tuple[int, bytes]) -> bytes:
    """A copy of `data` with bytes overwritten at the given offsets."""
    out = bytearray(data)
    for at, new in edits:
        out[at:at + len(new)] = new
    return bytes(out)


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


# --- naive reference forward ------------------------------------------------------------

def read_weights(path: str) -> tuple[dict[str, np.ndarray], dict]:
    """Every tensor dequantized straight from GGUFReader (float64, NumPy order), and hparams."""
    r = GGUFReader(path)
    arch = r.fields["general.architecture"].contents()

    def meta(key, default=None):
        f = r.fields.get(f"{arch}.{key}")
        return default if f is None else f.contents()

    hp = {"n_layers": meta("block_count"), "n_heads": meta("attention.head_count"),
          "n_kv": meta("attention.head_count_kv"), "base": meta("rope.freq_base", 10000.0),
          "eps": meta("attention.layer_norm_rms_epsilon", 1e-5)}
    weights = {}
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        weights[t.name] = dequantize(t.data, t.tensor_type).astype(np.float64).reshape(shape)
    return weights, hp


def reference_logits(path: str, tokens: list[int], loaded=None) -> np.ndarray:
    """Logits after every token [T, vocab]: textbook llama, contiguous K/V, float64."""
    W, hp = loaded if loaded is not None else read_weights(path)
    H, KV = hp["n_heads"], hp["n_kv"]
    x = W["token_embd.weight"][np.asarray(tokens)]          # [T, d]
    T, d = x.shape
    hd = d // H
    group = H // KV                                          # query heads per KV head

    def rmsnorm(v, g):
        return v / np.sqrt((v * v).mean(axis=-1, keepdims=True) + hp["eps"]) * g

    def rope(v):                                             # v [T, heads, hd]
        out = v.copy()
        for pos in range(T):
            for i in range(hd // 2):
                theta = pos * hp["base"] ** (-2.0 * i / hd)
                c, s = np.cos(theta), np.sin(theta)
                a, b = v[pos, :, 2 * i], v[pos, :, 2 * i + 1]
                out[pos, :, 2 * i] = a * c - b * s
                out[pos, :, 2 * i + 1] = a * s + b * c
        return out

    for layer in range(hp["n_layers"]):
        p = f"blk.{layer}."
        h = rmsnorm(x, W[p + "attn_norm.weight"])
        q = rope((h @ W[p + "attn_q.weight"].T).reshape(T, H, hd))
        k = rope((h @ W[p + "attn_k.weight"].T).reshape(T, KV, hd))
        v = (h @ W[p + "attn_v.weight"].T).reshape(T, KV, hd)
        att = np.zeros((T, H, hd))
        for head in range(H):
            kvh = head // group
            for t in range(T):
                scores = k[:t + 1, kvh] @ q[t, head] / np.sqrt(hd)   # [t+1]
                w = np.exp(scores - scores.max())
                att[t, head] = (w / w.sum()) @ v[:t + 1, kvh]
        x = x + att.reshape(T, d) @ W[p + "attn_output.weight"].T
        h = rmsnorm(x, W[p + "ffn_norm.weight"])
        gate = h @ W[p + "ffn_gate.weight"].T
        up = h @ W[p + "ffn_up.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ W[p + "ffn_down.weight"].T
    out = W.get("output.weight", W["token_embd.weight"])
    return rmsnorm(x, W["output_norm.weight"]) @ out.T
