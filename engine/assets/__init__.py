"""Files shipped with the engine; `DEMO_MODEL_DIR` is the bundled, trained demo Qwen3-MoE checkpoint."""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo-moe"
