"""Each provider's cache as a small named model (docs/design.md §14): the rule set's `behaviour`
picks one; its numbers come from the rule set's TOML file.

A model takes the requests in arrival order and says, for each, how many prompt tokens it reads
from the cache, how many it writes (default and long lifetime), and where the rest went (the
§15 parts the advisor can know: cached, rounding, below_minimum, expired, no_breakpoint,
overflow, new).
"""

from __future__ import annotations

from ..rules import RuleSet
from .anthropic import Breakpoints
from .core import PrefixCache, Step
from .deepseek import Units
from .openai import Routing

MODELS = {"prefix": PrefixCache, "anthropic-breakpoints": Breakpoints, "openai-routing": Routing,
          "deepseek-units": Units}


def make(rules: RuleSet) -> PrefixCache:
    """A fresh cache of `rules`' behaviour."""
    return MODELS[rules.behaviour](rules)


__all__ = ["MODELS", "Step", "make"]
