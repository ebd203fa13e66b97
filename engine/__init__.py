"""moegate's embedded hybrid MoE inference engine."""

import os

# torch's OpenMP workers keep spinning after each parallel region (libgomp's GOMP_SPINCOUNT, 300000 by
# default), on the cores the expert kernel's own pool uses between torch ops: prefill on 2 cores measured
# 705 -> 825 tok/s with 30000. libgomp reads it once, when torch loads, so it only applies where `engine`
# is imported before torch (the moegate CLI, `from engine import LLM` first); an explicit setting wins.
OPENMP_ENV = {"GOMP_SPINCOUNT": "30000"}
USER_OPENMP_ENV = {key: os.environ.get(key) for key in OPENMP_ENV}  # as found (benchmarks restore it)
for _key, _value in OPENMP_ENV.items():
    os.environ.setdefault(_key, _value)

__all__ = ["LLM", "AsyncLLM", "EngineConfig", "RequestOutput", "SamplingParams", "Mode"]


def __getattr__(name: str):
    # Heavy modules (torch) load on first use so `import engine` (and `engine.mode`, which the policies
    # import) stays cheap for the CLI.
    if name == "SamplingParams":
        from engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "Mode":
        from engine.mode import Mode

        return Mode
    if name in ("LLM", "EngineConfig", "RequestOutput", "LLMEngine"):
        from engine import llm_engine

        return getattr(llm_engine, name)
    if name == "AsyncLLM":
        from engine.async_engine import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)
