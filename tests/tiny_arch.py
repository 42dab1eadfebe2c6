"""Tiny qwen2, qwen3, llama-SentencePiece and gemma3 GGUFs for tests, and llama.cpp's logits on them.

`write_arch_gguf(path, arch)` writes a small model of that architecture with seeded random
float32 weights (so llama.cpp computes in float32 too) and the tokenizer the family uses:
byte-level BPE for qwen2/qwen3/llama3 (tests/tiny_gguf.py's vocabulary), SentencePiece for
llama-spm and gemma3. The files are byte-identical on every run, so the llama.cpp logits
stored in tests/data/tiny_arch_reference.json stay valid; `python -m tests.tiny_arch`
regenerates them with llama-cpp-python.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from gguf import GGUFWriter, LlamaFileType

from tests.tiny_gguf import tiny_vocab

ARCHS = ("qwen2", "qwen3", "llama-spm", "gemma3", "llama3")
REFERENCE_FILE = os.path.join(os.path.dirname(__file__), "data", "tiny_arch_reference.json")
D_MODEL, N_HEADS, N_KV_HEADS, N_FF, CONTEXT = 64, 4, 2, 96, 256
SPM_SPACE = "\u2581"
KEPT_POSITIONS = 12  # logits after the last 12 tokens are stored (all past gemma3's window of 8)
# Each arch: (GGUF architecture, layers, head dim, extra metadata)
SHAPES = {
    "qwen2": ("qwen2", 2, 16, {}),
    "qwen3": ("qwen3", 2, 32, {"attention.key_length": 32, "attention.value_length": 32}),
    "llama-spm": ("llama", 2, 16, {}),
    # six layers: five sliding (window 8) and one global, as Gemma 3's pattern of 6
    "gemma3": ("gemma3", 6, 32, {"attention.key_length": 32, "attention.value_length": 32,
                                 "attention.sliding_window": 8}),
    # Llama 3.1+: byte-level BPE with the llama-bpe split, RoPE frequencies divided by rope_freqs
    "llama3": ("llama", 2, 16, {}),
}
PIECES = ["▁t", "he", "▁the", "▁a", "in", "er", "▁s", "ll", "▁w", "ou", "an", "▁and", "ing",
          "▁in", "▁he", "▁wh", "en", "on", "▁o", "or", "is", "▁is", "at", "▁c", "it", "▁it"]
TEXTS = ["the wheel and the hill", "  two  spaces\nand a newline", "digits 12345, bytes é中🎉!",
         "<start_of_turn>user\nhi<end_of_turn>\n", "which is it?"]
TOKENS = {"qwen2": [40, 41, 42, 3, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 170, 5, 6],
          "llama3": [7, 17, 27, 37, 47, 57, 67, 77, 87, 97, 107, 117, 127, 137, 147, 157, 167, 177],
          "qwen3": [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155, 166, 177, 188, 199]}


def spm_vocab(arch: str) -> tuple[list[str], list[float], list[int], dict]:
    """Tokens, scores, token types and special ids of a small SentencePiece vocabulary."""
    if arch == "gemma3":
        head = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2), ("<start_of_turn>", 3),
                ("<end_of_turn>", 3), ("\n", 4), ("\n\n", 4), ("  ", 4)]
        ids = {"bos": 2, "eos": 1, "unk": 3, "add_space_prefix": False}
    else:
        head = [("<unk>", 2), ("<s>", 3), ("</s>", 3)]
        ids = {"bos": 1, "eos": 2, "unk": 0, "add_space_prefix": True}
    tokens = [t for t, _ in head] + [f"<0x{b:02X}>" for b in range(256)]
    types = [k for _, k in head] + [6] * 256
    chars = [SPM_SPACE] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + list(".,?!'")
    body = chars + PIECES
    tokens += body
    types += [1] * len(body)
    # SentencePiece scores: the earlier a piece, the sooner it merges (bytes and specials 0)
    scores = [0.0] * (len(head) + 256) + [-float(i) for i in range(len(body))]
    return tokens, scores, types, ids


def _weights(arch: str, vocab: int, seed: int) -> dict[str, np.ndarray]:
    gguf_arch, n_layers, hd, _ = SHAPES[arch]
    rng = np.random.default_rng(seed)
    d, q, kv, ff = D_MODEL, N_HEADS * hd, N_KV_HEADS * hd, N_FF

    def mat(rows, cols, scale=1.0):
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    def norm(n=d):
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    out = {"token_embd.weight": (0.5 * rng.standard_normal((vocab, d))).astype(np.float32)}
    for i in range(n_layers):
        p = f"blk.{i}."
        out |= {p + "attn_norm.weight": norm(), p + "attn_q.weight": mat(q, d, 2.0),
                p + "attn_k.weight": mat(kv, d, 2.0), p + "attn_v.weight": mat(kv, d),
                p + "attn_output.weight": mat(d, q), p + "ffn_norm.weight": norm(),
                p + "ffn_gate.weight": mat(ff, d), p + "ffn_up.weight": mat(ff, d),
                p + "ffn_down.weight": mat(d, ff)}
        if gguf_arch == "qwen2":
            out |= {p + "attn_q.bias": (0.3 * rng.standard_normal(q)).astype(np.float32),
                    p + "attn_k.bias": (0.3 * rng.standard_normal(kv)).astype(np.float32),
                    p + "attn_v.bias": (0.3 * rng.standard_normal(kv)).astype(np.float32)}
        if gguf_arch in ("qwen3", "gemma3"):
            out |= {p + "attn_q_norm.weight": norm(hd), p + "attn_k_norm.weight": norm(hd)}
        if gguf_arch == "gemma3":
            out |= {p + "post_attention_norm.weight": norm(), p + "post_ffw_norm.weight": norm()}
    out["output_norm.weight"] = norm()
    if arch == "llama3":  # frequency divisors from 1 (high frequencies) to 8 (low), as Llama 3.1's
        out["rope_freqs.weight"] = np.linspace(1.0, 8.0, hd // 2).astype(np.float32)
    if gguf_arch == "qwen2":  # untied, as Qwen2 7B; the others tie the head to the embedding
        out["output.weight"] = mat(vocab, d, 4.0)
    return out


def arch_metadata(arch: str) -> dict:
    """Every metadata key of the tiny model of `arch`, in writing order."""
    gguf_arch, n_layers, _hd, extra = SHAPES[arch]
    meta = {"general.name": f"tiny-{arch}", "general.file_type": int(LlamaFileType.ALL_F32)}
    for key, value in {"context_length": CONTEXT, "embedding_length": D_MODEL, "block_count": n_layers,
                       "feed_forward_length": N_FF, "attention.head_count": N_HEADS,
                       "attention.head_count_kv": N_KV_HEADS, **extra}.items():
        meta[f"{gguf_arch}.{key}"] = value
    meta[f"{gguf_arch}.rope.freq_base"] = 1e6 if gguf_arch == "gemma3" else 10000.0
    meta[f"{gguf_arch}.attention.layer_norm_rms_epsilon"] = 1e-6
    t = "tokenizer.ggml."
    if arch in ("qwen2", "qwen3", "llama3"):
        tokens, merges, types = tiny_vocab()
        pre = "llama-bpe" if arch == "llama3" else "qwen2"
        meta |= {t + "model": "gpt2", t + "pre": pre, t + "tokens": tokens, t + "token_type": types,
                 t + "merges": merges, t + "eos_token_id": 2, t + "add_bos_token": False}
    else:
        tokens, scores, types, ids = spm_vocab(arch)
        meta |= {t + "model": "llama", t + "pre": "default", t + "tokens": tokens, t + "scores": scores,
                 t + "token_type": types, t + "bos_token_id": ids["bos"], t + "eos_token_id": ids["eos"],
                 t + "unknown_token_id": ids["unk"], t + "add_bos_token": True,
                 t + "add_space_prefix": ids["add_space_prefix"]}
    return meta


def _add(w: GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, int):
        (w.add_uint64 if value >= 1 << 32 else w.add_uint32)(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    else:
        w.add_array(key, list(value))


def write_arch_gguf(path, arch: str, seed: int = 7, metadata: dict | None = None,
                    tensors: dict[str, np.ndarray] | None = None) -> str:
    """Write the tiny model of `arch` (one of ARCHS); `metadata` and `tensors` replace or add entries."""
    path = os.fspath(path)
    meta = arch_metadata(arch) | (metadata or {})
    w = GGUFWriter(path, SHAPES[arch][0])
    for key, value in meta.items():
        _add(w, key, value)
    n_vocab = len(arch_metadata(arch)["tokenizer.ggml.tokens"])
    for name, arr in (_weights(arch, n_vocab, seed) | (tensors or {})).items():
        w.add_tensor(name, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_cpp_outputs(path: str, arch: str) -> dict:
    """llama.cpp's tokenizations of TEXTS and logits after every test token (llama-cpp-python)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=CONTEXT, n_threads=1, logits_all=True,
                          verbose=False, seed=0)
    texts = [{"text": t, "ids": llm.tokenize(t.encode("utf-8"), add_bos=False, special=True)}
             for t in TEXTS]
    tokens = TOKENS.get(arch) or llm.tokenize(" ".join(TEXTS[:2]).encode("utf-8"), add_bos=True,
                                              special=True)
    llm.reset()
    llm.eval(tokens)
    logits = np.asarray(llm.scores[:len(tokens)], dtype=np.float32)[-KEPT_POSITIONS:]
    llm.close()
    return {"texts": texts, "tokens": [int(t) for t in tokens], "logits": logits.round(3).tolist()}


def main(out_dir: str) -> None:
    """Write the tiny models into out_dir and store llama.cpp's outputs on them in tests/data."""
    import llama_cpp

    ref = {"llama_cpp": llama_cpp.__version__, "archs": {}}
    for arch in ARCHS:
        path = write_arch_gguf(os.path.join(out_dir, f"{arch}.gguf"), arch)
        ref["archs"][arch] = llama_cpp_outputs(path, arch)
    with open(REFERENCE_FILE, "w", encoding="utf-8") as fh:
        json.dump(ref, fh)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
