"""The OpenAI-compatible server and the KV-event publisher (DESIGN §8, §9)."""
