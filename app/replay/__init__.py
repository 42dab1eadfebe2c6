"""Traces and what-if replay: record, import, redact and replay request streams (docs/design.md §10)."""
