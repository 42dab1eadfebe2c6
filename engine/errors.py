"""Errors the engine raises on bad input; each message names what was wrong."""


class ModelLoadError(Exception):
    """A GGUF file could not be loaded: the message names the file and the problem."""


class PoolExhausted(RuntimeError):
    """The KV pool has no free page and the prefix cache holds nothing evictable."""


class TemplateError(ValueError):
    """A chat template failed to render (or tried to escape the sandbox)."""
