"""Serving: the OpenAI-compatible HTTP server over the scheduler (DESIGN §8)."""
