"""PrefixLab's inference engine: GGUF models on NumPy with a paged KV pool and a prefix cache.

No Qt here, ever: the engine is a library (`import engine as dl`).
"""

import importlib

from .tuning import tune_process as tune_process  # at once: it imports no NumPy

# Each public name's module, imported on first use: `import engine` loads no NumPy and changes
# nothing, so an entry point can call tune_process() before NumPy loads OpenBLAS.
_API = {
    "api": ("create_kv_pool", "create_prefix_cache", "create_session", "decode", "encode", "eval",
            "eval_batch", "prefix_attach", "prefix_chain_list", "prefix_held_groups", "prefix_held_pages",
            "prefix_insert", "prefix_pin", "prefix_probe", "prefix_release", "prefix_unpin",
            "release_kv_pages"),
    "block_manager": ("BlockManager",),
    "config": ("ModelConfig",),
    "errors": ("ModelLoadError", "PoolExhausted", "TemplateError"),
    "kv_pool": ("KVPool", "Session"),
    "loader": ("Model", "default_model_path", "load_model"),
    "prefix_cache": ("PrefixCache",),
    "prefix_records": ("CachedPageInfo", "CacheEvent", "ChainRecord", "ProbeResult"),
    "registry": ("BUILTIN_MODELS", "BuiltinModel", "ModelNotInstalled", "resolve_model"),
    "sampler": ("Sampler", "SamplingParams"),
    "token_parts": ("PARTS", "Account", "Eviction", "TokenParts"),
}
_MODULE_OF = {name: module for module, names in _API.items() for name in names}

__all__ = sorted([*_MODULE_OF, "tune_process"])


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
