"""The prompt-caching advisor: hosted APIs' cache rules applied to a person's traffic (docs/design.md §14)."""
