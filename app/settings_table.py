"""The settings table: each preference's default, limits, label and tip, stated once.

The Settings dialog builds its widgets from `rows()`, `AppSettings` takes its defaults and
validation limits from `SETTINGS`, and the headless commands take their help texts and
limits from it too. Qt-free, so the command line can read it without loading Qt.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.kv_pool import KV_DTYPES
from engine.sampler import SamplingParams
from engine.scheduler import SchedulerSettings
from engine.stream import MAX_NEW_TOKENS

from .serve.budget import DEFAULT_KV_BUDGET

# The window alone departs from the engine's sampling defaults, here: it starts with
# llama.cpp's long-standing 1.1 repetition penalty, because small models tend to loop in
# greedy answers. The engine, `prefixlab run` and the server keep 1.0 (off), as OpenAI
# clients and today's llama.cpp expect.
WINDOW_REPEAT_PENALTY = 1.1
MAX_SPEC_K = 16      # drafted tokens per stream and step, at most


@dataclass(frozen=True)
class Setting:
    """One preference: its group, kind, default, limits, label and tip."""

    name: str
    group: str              # pool | scheduler | sampling | server
    kind: str               # int | float | bool | text | secret | choice
    default: object
    label: str
    tip: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # the limit itself is not allowed
    high_open: bool = False
    step: float = 1.0
    decimals: int = 0
    special: str = ""       # what a spin box shows at its minimum (e.g. "0 (grows)")
    text: str = ""          # a check box's own text, or a line edit's placeholder
    choices: tuple = ()     # a choice's values, as stored (a combo box shows them)

    def range_words(self) -> str:
        """The limits as a sentence's end: "above 0 and at most 1"."""
        low, high = _number(self.low), _number(self.high)
        low = f"above {low}" if self.low_open else f"at least {low}"
        high = f"below {high}" if self.high_open else f"at most {high}"
        return f"{low} and {high}"

    def out_of_range(self, value) -> bool:
        """True when `value` is not a number of this setting's kind within its limits."""
        if self.kind == "int" and (not isinstance(value, int) or isinstance(value, bool)):
            return True
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
            return True
        below = value <= self.low if self.low_open else value < self.low
        above = value >= self.high if self.high_open else value > self.high
        return below or above


def _number(x: float) -> str:
    return f"{x:,}" if float(x).is_integer() and abs(x) >= 1000 else f"{x:g}"


_S, _P = SchedulerSettings(), SamplingParams()

TABLE: tuple[Setting, ...] = (
    Setting("page_rows", "pool", "int", _S.page_rows, "Page rows",
            "Positions per KV page: the cache shares whole pages only", 1, 4096),
    Setting("pool_pages", "pool", "int", 0, "Pool pages",
            "Pages in the pool (running requests and the prefix cache share them); 0: the default KV "
            f"budget, {DEFAULT_KV_BUDGET} of this machine's RAM, as prefixlab serve starts with (the model "
            "bar shows it)",
            0, 1_000_000, special="0 (KV budget)"),
    Setting("cache_pages", "pool", "int", _S.cache_pages, "Cache budget (pages)",
            "Most pages the cache may keep, within the pool; 0: no budget of its own (the pool's bound)",
            0, 1_000_000, special="0 (the pool's)"),
    Setting("cache_enabled", "pool", "bool", _S.cache_enabled, "Prefix cache",
            "Off: every prompt is prefilled in full (for comparison)", text="Reuse cached prefixes"),
    Setting("kv_dtype", "pool", "choice", _S.kv_dtype, "KV page dtype",
            "How pages store K and V: float16 halves the bytes per page (twice the pages in the same "
            "memory); attention still computes in float32, and a hit still equals a miss exactly",
            choices=tuple(KV_DTYPES)),
    Setting("disk_tier_pages", "pool", "int", _S.disk_tier_pages, "Disk tier pages",
            "Pages of a disk tier under the pool: a cached page about to be evicted moves to a "
            "file on disk and a later hit loads it back instead of recomputing it; 0: off",
            0, 1_000_000, special="0 (off)"),
    Setting("keep_cache", "pool", "bool", False, "Keep the cache across restarts",
            "The cache is saved at quit (and by Run → Save the cache now) and loaded after the model "
            "loads, so the first question after a restart hits. The file lives in the kv-cache folder "
            "beside this app's settings file, one per model, page rows and dtype; a damaged file is "
            "moved aside with one status line", text="Save at quit, load at start"),
    Setting("namespace", "pool", "text", "", "Namespace",
            "A salt for cache keys: prompts only share pages within one namespace", text="(none)"),
    Setting("max_streams", "scheduler", "int", _S.max_streams, "Max streams",
            "Streams decoded together in one batch", 1, 64),
    Setting("chunk_tokens", "scheduler", "int", _S.chunk_tokens, "Chunk tokens",
            "Prompt tokens prefilled per step (shared by all streams)", 1, 65_536),
    Setting("spec_enabled", "scheduler", "bool", _S.spec_enabled, "Speculative decoding",
            "Drafts up to k tokens per stream from n-grams of the prompt, verified in the same pass; "
            "greedy output unchanged. Off by default: it measured slower on 2 cores for the shipped "
            "workloads", text="Draft tokens from the prompt"),
    Setting("spec_k", "scheduler", "int", _S.spec_k, "Draft tokens (k)",
            "Tokens drafted and verified per stream and step, at most", 1, MAX_SPEC_K),
    Setting("temperature", "sampling", "float", _P.temperature, "Temperature",
            "0: greedy (always the most likely token)", 0.0, 10.0, step=0.1, decimals=2),
    Setting("top_k", "sampling", "int", _P.top_k, "Top-k",
            "Keep the k most likely tokens; 0: off", 0, 1_000_000),
    Setting("top_p", "sampling", "float", _P.top_p, "Top-p",
            "Keep the smallest set of tokens whose probability reaches p", 0.0, 1.0, low_open=True,
            step=0.05, decimals=2),
    Setting("min_p", "sampling", "float", _P.min_p, "Min-p",
            "Drop tokens less likely than min-p × the top token", 0.0, 1.0, high_open=True,
            step=0.01, decimals=3),
    Setting("repeat_penalty", "sampling", "float", WINDOW_REPEAT_PENALTY, "Repetition penalty",
            f"Above 1 discourages repeating recent tokens. The window starts at {WINDOW_REPEAT_PENALTY:g}, "
            f"llama.cpp's long-standing default, because small models tend to loop in greedy answers; "
            f"prefixlab run and the server use {_P.repeat_penalty:g} (off), as the engine does",
            0.0, 10.0, low_open=True, step=0.05, decimals=2),
    Setting("seed", "sampling", "int", -1, "Seed",
            "A fixed seed makes sampling repeatable; -1: a fresh seed per request", -1, 2**31 - 1,
            special="random"),
    Setting("max_new_tokens", "sampling", "int", MAX_NEW_TOKENS, "Max new tokens",
            "Longest answer, in tokens", 1, 65_536),
    Setting("server_host", "server", "text", "127.0.0.1", "Server host",
            "Address to listen on: 127.0.0.1 is this machine only; 0.0.0.0 is every network this "
            "machine is on"),
    Setting("server_port", "server", "int", 8000, "Server port",
            "TCP port; clients use http://host:port/v1", 1, 65_535),
    Setting("server_api_key", "server", "secret", "", "Server API key",
            "Clients must send 'Authorization: Bearer <key>'; the key is also their cache namespace",
            text="(none: no key asked)"),
    Setting("server_api_key_remember", "server", "bool", False, "Remember the API key",
            "The key goes to the system keyring where there is one. Without a keyring it is kept only "
            "when this is ticked, in a file only you can read; unticked, it is forgotten at quit",
            text="Remember the key"),
    Setting("server_kv_events", "server", "text", "", "Server KV events",
            "Publish the prefix cache as KV events in vLLM's format on this ZeroMQ endpoint "
            "(File → Watch a server, llm-d, Dynamo read it); ZeroMQ has no authentication: keep it on "
            "127.0.0.1", text="(off) e.g. 127.0.0.1:5557"),
)
SETTINGS: dict[str, Setting] = {s.name: s for s in TABLE}


def default(name: str):
    """The default value of setting `name`."""
    return SETTINGS[name].default


def rows() -> list[dict]:
    """The table as plain dicts, for widgets that must not import app/."""
    return [asdict(s) for s in TABLE]


def cli_help(name: str) -> str:
    """A command-line option's help: the setting's tip, with its limits when it has some."""
    s = SETTINGS[name]
    return s.tip if s.low is None else f"{s.tip} ({s.range_words()})"
