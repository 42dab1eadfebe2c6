"""Make traces: redacted, or converted from an OpenAI request log.

A redacted trace is the Mooncake form: chained
block hashes (renumbered 0, 1, 2... in order of first use), lengths and times,
no token ids, so it can be shared without the text it came from.
"""

from __future__ import annotations

from collections.abc import Iterator

from engine.prefix_cache import PrefixCache

from .trace import TraceError, TraceHeader, TraceSource, write_mooncake, write_trace


def redacted_rows(requests, block_size: int) -> Iterator[dict]:
    """Mooncake rows of token-trace requests: chained block hashes of `block_size` tokens."""
    keys = PrefixCache()  # the cache's own chained key: page i hashes page i-1's key and its tokens
    numbers: dict[int, int] = {}
    for r in requests:
        if r.prompt is None:
            raise TraceError("this trace holds no token ids to redact (it is a hash-id trace already)")
        ids, parent = [], None
        for i in range(0, len(r.prompt), block_size):
            parent = keys.page_key(parent, r.prompt[i:i + block_size], r.namespace)
            ids.append(numbers.setdefault(parent, len(numbers)))
        yield {"timestamp": round(r.arrival_s * 1000), "input_length": r.input_length,
               "output_length": r.output_length, "hash_ids": ids}


def redact_trace(source: TraceSource, out_path: str, block_size: int | None = None) -> int:
    """Write a token trace's Mooncake form (block size: the trace's page size unless given)."""
    if source.hashed:
        raise TraceError(f"{source.path} is a hash-id trace already: nothing to redact")
    block = block_size or source.header.page_rows or 16
    return write_mooncake(out_path, redacted_rows(source, block))


def convert_to_prefixlab(source: TraceSource, out_path: str, page_rows: int = 16) -> TraceSource:
    """Write a token trace (e.g. an OpenAI log, tokenized now) as a prefixlab trace and open it."""
    header = TraceHeader(page_rows=source.header.page_rows or page_rows, source=source.format,
                         model=source.header.model)
    write_trace(out_path, header, source)
    return TraceSource(path=out_path, format="prefixlab", header=header)
