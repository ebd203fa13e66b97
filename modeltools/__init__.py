"""Offline model tooling beside the runtime: random checkpoints with real vocabularies, GGUF writing, sizing
(`moegate model init-random`, `moegate plan`). The engine never imports this package."""
