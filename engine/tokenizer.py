"""Byte-level BPE tokenizer built from GGUF metadata (chat templates: engine/chat.py)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from .chat import render_template
from .errors import ModelLoadError

# llama.cpp token types that are parsed as whole tokens in text.
CONTROL, USER_DEFINED = 3, 4

# GPT-2 style split used by llama.cpp's "llama-bpe" (Llama 3) pre-tokenizer.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm",):
        # llama.cpp splits digits one by one before the GPT-2 regex.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    return byte_level


def build_tokenizer(path: str, model: str, pre: str, tokens: list[str], merges: list[str],
                    token_types) -> Tokenizer:
    """A `tokenizers.Tokenizer` equal to llama.cpp's for a gpt2-style GGUF vocabulary."""
    if model != "gpt2":
        raise ModelLoadError(
            f"{path}: unsupported tokenizer model '{model}'; supported: gpt2 (byte-level BPE)")
    if not tokens or merges is None:
        raise ModelLoadError(f"{path}: missing tokenizer.ggml.tokens or tokenizer.ggml.merges")
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
    if token_types is not None:
        if len(token_types) != len(tokens):
            raise ModelLoadError(f"{path}: tokenizer.ggml.token_type has {len(token_types)} entries, "
                                 f"expected one per token ({len(tokens)})")
        special = [tokens[i] for i, t in enumerate(token_types) if int(t) in (CONTROL, USER_DEFINED)]
        tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    return tk


@dataclass
class TextTokenizer:
    """Encode, decode, stream-decode and apply the chat template."""

    tokenizer: Tokenizer
    chat_template: str
    eos_ids: tuple[int, ...]
    bos_id: int | None = None
    template_warning: str = ""

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text are parsed; no BOS."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

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
