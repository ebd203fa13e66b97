"""Constrained decoding (JSON Schema, tool calls, SQL) and validation of structured outputs."""
