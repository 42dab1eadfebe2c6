"""Serving: the OpenAI-compatible HTTP server over the scheduler (docs/design.md §8)."""
