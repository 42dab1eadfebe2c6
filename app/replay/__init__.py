"""Traces and what-if replay: record, import, redact and replay request streams (DESIGN §10)."""
