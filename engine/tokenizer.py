"""Tokenizers built from GGUF metadata: byte-level BPE and SentencePiece (chat templates: engine/chat.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from .chat import render_template
from .errors import ModelLoadError

# llama.cpp token types (llama_token_type): CONTROL, USER_DEFINED and UNKNOWN tokens are
# parsed as whole tokens in text before the model's own splitting.
UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(7)
SPM_SPACE = "\u2581"  # SentencePiece's visible space marker
TOKENIZER_MODELS = ("gpt2", "llama")
# Texts this long are encoded with the GIL released (TextTokenizer.encode says why). Shorter ones
# keep plain `encode`: `encode_batch` starts tokenizers' thread pool, and a process forked after
# that (replay's sweep workers) prints a warning.
LONG_TEXT_CHARS = 1 << 16

# GPT-2 style split used by llama.cpp's "llama-bpe" (Llama 3) pre-tokenizer.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# llama.cpp's "qwen2" split: Llama 3's with single digits.
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
SPLITS = {"llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}


def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm",):
        # llama.cpp splits digits one by one before the GPT-2 regex.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    return byte_level


def _check_types(path: str, tokens: list[str], token_types) -> list[int] | None:
    if token_types is None:
        return None
    if len(token_types) != len(tokens):
        raise ModelLoadError(f"{path}: tokenizer.ggml.token_type has {len(token_types)} entries, "
                             f"expected one per token ({len(tokens)})")
    types = [int(t) for t in token_types]
    bad = next((i for i, t in enumerate(types) if not UNDEFINED <= t <= BYTE), None)
    if bad is not None:
        raise ModelLoadError(f"{path}: tokenizer.ggml.token_type[{bad}] = {types[bad]} is not a "
                             f"llama.cpp token type ({UNDEFINED}..{BYTE})")
    return types


def _add_parsed_tokens(tk: Tokenizer, tokens: list[str], types: list[int] | None) -> None:
    """Control/unknown tokens as specials, user-defined ones as plain added text (llama.cpp's split)."""
    if types is None:
        return
    added = [AddedToken(tokens[i], special=t != USER_DEFINED, normalized=False)
             for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED, UNKNOWN) and tokens[i]]
    tk.add_tokens(added)


def _gpt2_tokenizer(path: str, pre: str, tokens: list[str], merges: list[str] | None) -> Tokenizer:
    if merges is None:
        raise ModelLoadError(f"{path}: missing tokenizer.ggml.merges")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ModelLoadError(f"{path}: malformed merge {m!r} in tokenizer.ggml.merges")
        if a not in vocab or b not in vocab or a + b not in vocab:
            # tokenizers would panic (an uncatchable-by-Exception PanicException) on these
            raise ModelLoadError(f"{path}: merge {m!r} in tokenizer.ggml.merges names a token "
                                 f"missing from tokenizer.ggml.tokens")
        pairs.append((a, b))
    try:
        tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=False))
    except Exception as e:  # tokenizers reports merges of unknown tokens as a bare Exception
        raise ModelLoadError(f"{path}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens ({e})") from e
    tk.pre_tokenizer = _pre_tokenizer(pre)
    tk.decoder = decoders.ByteLevel()
    return tk


def spm_merges(tokens: list[str], scores) -> list[tuple[str, str]]:
    """Every split of every token into two tokens, best merged-token score first.

    llama.cpp's SentencePiece tokenizer repeatedly joins the adjacent pair whose joined text
    is the highest-scoring token (the leftmost on a tie); BPE with these ranks makes the
    same choices.
    """
    known = set(tokens)
    ids, cuts = [], []
    for i, tok in enumerate(tokens):
        for cut in range(1, len(tok)):
            if tok[:cut] in known and tok[cut:] in known:
                ids.append(i)
                cuts.append(cut)
    id_arr, cut_arr = np.asarray(ids, dtype=np.int64), np.asarray(cuts, dtype=np.int64)
    order = np.lexsort((cut_arr, id_arr, -np.asarray(scores, dtype=np.float64)[id_arr]))
    return [(tokens[i][:c], tokens[i][c:]) for i, c in zip(id_arr[order].tolist(), cut_arr[order].tolist())]


def _spm_tokenizer(path: str, tokens: list[str], scores, add_space_prefix: bool,
                   unk_id: int | None) -> Tokenizer:
    if scores is None:
        scores = [0.0] * len(tokens)  # llama.cpp's default when the file has none
    if len(scores) != len(tokens):
        raise ModelLoadError(f"{path}: tokenizer.ggml.scores has {len(scores)} entries, "
                             f"expected one per token ({len(tokens)})")
    if not np.isfinite(np.asarray(scores, dtype=np.float64)).all():
        raise ModelLoadError(f"{path}: tokenizer.ggml.scores contains NaN or infinity")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    try:
        tk = Tokenizer(models.BPE(vocab=vocab, merges=spm_merges(tokens, scores), unk_token=unk,
                                  fuse_unk=True, byte_fallback=True, ignore_merges=False))
    except Exception as e:
        raise ModelLoadError(f"{path}: SentencePiece vocabulary is unusable ({e})") from e
    # llama.cpp: ' ' becomes the marker, and a text piece after the start or a special gets one
    # leading marker when add_space_prefix is set; the tokenizer splits specials out first, so
    # normalizing each remaining piece does exactly that.
    steps = [normalizers.Prepend(SPM_SPACE)] if add_space_prefix else []
    tk.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPM_SPACE)])
    dec = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tk.decoder = decoders.Sequence(dec)
    return tk


def build_tokenizer(path: str, model: str, pre: str, tokens: list[str], merges: list[str] | None,
                    token_types, scores=None, add_space_prefix: bool = False,
                    unk_id: int | None = None) -> Tokenizer:
    """A `tokenizers.Tokenizer` equal to llama.cpp's: gpt2 (byte-level BPE) or llama (SentencePiece)."""
    if model not in TOKENIZER_MODELS:
        raise ModelLoadError(f"{path}: unsupported tokenizer model '{model}'; supported: "
                             f"gpt2 (byte-level BPE), llama (SentencePiece)")
    if not tokens:
        raise ModelLoadError(f"{path}: missing tokenizer.ggml.tokens")
    if len(set(tokens)) != len(tokens):
        seen: dict[str, int] = {}
        dup = next(i for i, t in enumerate(tokens) if seen.setdefault(t, i) != i)
        raise ModelLoadError(f"{path}: duplicate token {tokens[dup]!r} in tokenizer.ggml.tokens "
                             f"(ids {seen[tokens[dup]]} and {dup})")
    types = _check_types(path, tokens, token_types)
    if model == "gpt2":
        tk = _gpt2_tokenizer(path, pre, tokens, merges)
    else:
        tk = _spm_tokenizer(path, tokens, scores, add_space_prefix, unk_id)
    _add_parsed_tokens(tk, tokens, types)
    return tk


@dataclass
class TextTokenizer:
    """Encode, decode, stream-decode and apply the chat template."""

    tokenizer: Tokenizer
    chat_template: str
    eos_ids: tuple[int, ...]
    bos_id: int | None = None
    template_warning: str = ""
    add_bos: bool = False  # the model expects BOS at the head of every prompt (tokenizer.ggml.add_bos_token)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text are parsed; no BOS."""
        if len(text) < LONG_TEXT_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        # `encode` holds the GIL throughout: a 6 MB prompt stalled every other thread (the
        # server's event loop, /health included) for 8 s. `encode_batch` lets it go; same ids.
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    @property
    def prompt_prefix_ids(self) -> list[int]:
        """What every prompt starts with: [BOS] for models that want it (Gemma), else nothing (SmolLM2)."""
        return [self.bos_id] if self.add_bos and self.bos_id is not None else []

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a whole prompt: `encode` plus the BOS the model wants, unless the text already has it."""
        ids = self.encode(text)
        prefix = self.prompt_prefix_ids
        return ids if ids[:len(prefix)] == prefix else prefix + ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.id_to_token(int(token_id)) or ""

    def stream(self) -> TokenStream:
        return TokenStream(self.tokenizer)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template applied to `messages`, rendered in Jinja2's sandbox."""
        return render_template(self.chat_template, messages, add_generation_prompt,
                               bos_token=self.token_text(self.bos_id) if self.bos_id is not None else "",
                               eos_token=self.token_text(self.eos_ids[0]) if self.eos_ids else "")


class TokenStream:
    """Turns generated token ids into text pieces, holding back split UTF-8 bytes."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._stream = decoders.DecodeStream(skip_special_tokens=True)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tokenizer, int(token_id)) or ""
