"""moegate's embedded hybrid MoE inference engine."""

from engine.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "EngineConfig", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # Heavy modules load on first use so `import engine` stays cheap for the CLI.
    if name in ("LLM", "EngineConfig", "RequestOutput", "LLMEngine"):
        from engine import llm_engine

        return getattr(llm_engine, name)
    if name == "AsyncLLM":
        from engine.async_engine import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)
