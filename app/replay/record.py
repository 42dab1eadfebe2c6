"""Make traces: from a scheduler's finished requests, redacted, or from an OpenAI request log.

`save_session_trace` is the one call the app, the server and `prefixlab run` use to
save what a scheduler did. A redacted trace is the Mooncake form: chained block
hashes (renumbered 0, 1, 2... in order of first use), lengths and times, no token
ids, so it can be shared without the text it came from.
"""

from __future__ import annotations

from collections.abc import Iterator

from engine.prefix_cache import PrefixCache
from engine.scheduler import SchedulerSettings

from .trace import TraceError, TraceHeader, TraceRequest, TraceSource, write_mooncake, write_trace


def session_requests(sch) -> list[TraceRequest]:
    """The scheduler's finished requests as a timed trace, in admission order (never-run ones last)."""
    out = []
    for rid, toks in sch.ended_tokens().items():
        rec = sch.record(rid)
        out.append(TraceRequest(
            arrival_s=rec.submitted_s, input_length=len(toks.prompt), output_length=rec.n_gen,
            namespace=rec.namespace, client=rec.client, prompt=toks.prompt.tolist(),
            donated=None if toks.donated is None else toks.donated.tolist(),
            admitted_s=toks.admitted_s, finish_s=toks.donated_s))
    out.sort(key=lambda r: (r.admitted_s is None, r.admitted_s or 0.0))
    return out


def session_header(sch, model_name: str = "", source: str = "session") -> TraceHeader:
    """A session trace's header: its page size and scheduler settings."""
    return TraceHeader(page_rows=sch.settings.page_rows, model=model_name, source=source,
                       settings=sch.settings.to_dict())


def save_session_trace(path: str, sch, model_name: str = "", source: str = "session",
                       redact: bool = False) -> int:
    """Write the scheduler's finished requests as a trace (or, redacted, its Mooncake form with
    blocks of the session's page size); return how many requests."""
    requests = session_requests(sch)
    if redact:
        return write_mooncake(path, redacted_rows(requests, sch.settings.page_rows))
    return write_trace(path, session_header(sch, model_name, source), requests)


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
    block = block_size or source.header.page_rows  # a token trace always has its page size
    return write_mooncake(out_path, redacted_rows(source, block))


def convert_to_prefixlab(source: TraceSource, out_path: str) -> TraceSource:
    """Write a token trace (e.g. an OpenAI log, tokenized now) as a prefixlab trace and open it;
    an OpenAI log gets the scheduler's default page size as its own."""
    header = TraceHeader(page_rows=source.header.page_rows or SchedulerSettings().page_rows,
                         source=source.format, model=source.header.model)
    write_trace(out_path, header, source)
    return TraceSource(path=out_path, format="prefixlab", header=header)
