"""PrefixLab's inference engine: GGUF models on NumPy with a paged KV pool and a prefix cache.

No Qt here, ever: the engine is a library (`import engine as dl`).
"""

import os as _os

# OpenBLAS's idle threads spin for 2^28 cycles (~0.1 s) after each threaded call, on the core
# a decode pass's split helper needs (engine/split.py): after a prefill or a GEMV, one stream's
# tokens took 30-34 ms instead of 22. 2^22 cycles (~1.5 ms) still spans the gaps between a
# pass's calls. OpenBLAS reads it when NumPy loads it: import engine first, or set it yourself.
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "22")

from .api import (  # noqa: E402 - after the setting above
    create_kv_pool,
    create_prefix_cache,
    create_session,
    decode,
    encode,
    eval,
    eval_batch,
    prefix_attach,
    prefix_chain_list,
    prefix_held_groups,
    prefix_held_pages,
    prefix_insert,
    prefix_pin,
    prefix_probe,
    prefix_release,
    prefix_unpin,
    release_kv_pages,
)
from .arena import configure_malloc
from .block_manager import BlockManager
from .config import ModelConfig
from .errors import ModelLoadError, PoolExhausted, TemplateError
from .kv_pool import KVPool, Session
from .loader import Model, default_model_path, load_model
from .prefix_cache import PrefixCache
from .prefix_records import CachedPageInfo, CacheEvent, ChainRecord, ProbeResult
from .registry import BUILTIN_MODELS, BuiltinModel, ModelNotInstalled, resolve_model
from .sampler import Sampler, SamplingParams
from .token_parts import PARTS, Account, Eviction, TokenParts

configure_malloc()  # before any engine thread allocates (engine/arena.py)

__all__ = [
    "BUILTIN_MODELS", "PARTS", "Account", "BlockManager", "BuiltinModel",
    "CacheEvent", "CachedPageInfo", "ChainRecord",
    "Eviction", "KVPool", "Model", "ModelConfig", "ModelLoadError", "ModelNotInstalled", "PoolExhausted",
    "PrefixCache", "ProbeResult", "Sampler", "SamplingParams", "Session", "TemplateError",
    "TokenParts", "create_kv_pool", "create_prefix_cache", "create_session", "decode", "default_model_path",
    "encode", "eval", "eval_batch", "load_model", "prefix_attach", "prefix_chain_list",
    "prefix_held_groups", "prefix_held_pages", "prefix_insert", "prefix_pin", "prefix_probe",
    "prefix_release", "prefix_unpin", "release_kv_pages", "resolve_model",
]
