"""A recording proxy in front of any OpenAI-compatible server (docs/design.md §14)."""
