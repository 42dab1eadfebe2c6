"""The recording proxy's bounds, each a `prefixlab proxy` flag (light: the parser reads them
without loading the server's stack)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

DEFAULT_MAX_DECODED_BYTES = 16 << 20
DEFAULT_MAX_LINE_BYTES = 1 << 20
DEFAULT_RECORD_MAX_BYTES = 256 << 20


@dataclass(frozen=True)
class Limits:
    """What one exchange may take; each field is a `prefixlab proxy` flag of the same name."""

    connect_timeout: float = 10.0
    read_timeout: float = 600.0  # between two bytes of an answer: a long prompt's first token takes a while
    total_timeout: float = 3600.0  # a whole exchange, a stream included
    upstream_connections: int = 100  # to the upstream, all requests together
    max_body_bytes: int = 64 << 20
    max_answer_bytes: int = 64 << 20  # a non-streamed answer is held whole (a cut one becomes a clean 502)
    max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"--{f.name.replace('_', '-')} must be a number > 0, got {value!r}")
