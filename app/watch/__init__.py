"""Watch serving engines' prefix caches: vLLM KV-event feeds and llama.cpp servers (docs/design.md §9)."""
