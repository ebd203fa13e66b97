"""The policy's sections that a resolved request carries: limits, precision profiles, SQL rules, audit settings."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError
from sqlglot.dialects.dialect import Dialects

SQL_DIALECTS = sorted(d.value for d in Dialects if d.value)


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Limits(StrictModel):
    """Per-tenant limits. `None` means unlimited; fields left out of an override inherit."""

    requests_per_min: Annotated[int, Field(gt=0)] | None = None
    request_burst: Annotated[int, Field(gt=0)] | None = None
    tokens_per_min: Annotated[int, Field(gt=0)] | None = None
    token_burst: Annotated[int, Field(gt=0)] | None = None
    concurrency: Annotated[int, Field(gt=0)] | None = None
    max_tokens: Annotated[int, Field(gt=0)] | None = None
    tokens_per_day: Annotated[int, Field(gt=0)] | None = None

    def overlay(self, override: Limits | None) -> Limits:
        """Fields explicitly set in `override` (even to null) replace ours."""
        if override is None:
            return self
        values = self.model_dump()
        values.update({k: getattr(override, k) for k in override.model_fields_set})
        return Limits(**values)


class HotExperts(StrictModel):
    """Routed experts served from a faster tier, chosen by routing counts: on the GPU (`gpu_per_layer`,
    bf16; ignored without CUDA) or kept at `formatting_dtype` in host memory (`exact_share`, mixed
    precision). Exploration profiles only: execution's numerics must not depend on the traffic."""

    gpu_per_layer: Annotated[int, Field(ge=0, description="experts per MoE layer resident on the GPU")] = 0
    exact_share: Annotated[float, Field(ge=0, le=1, description=(
        "share of each layer's experts kept at formatting_dtype in host memory (mixed precision)"))] = 0.0
    strategy: Annotated[Literal["uniform", "frequency", "dynamic"], Field(description=(
        "uniform: experts 0..n-1; frequency: the most routed in stats_file; dynamic: starts from stats_file "
        "(or uniform) and follows the traffic, swaps applied between engine steps"))] = "dynamic"
    stats_file: Annotated[str | None, Field(description="routing counts (JSON) written by the engine")] = None
    interval_steps: Annotated[int, Field(ge=1, description="engine steps between two looks at the counts")] = 64
    decay: Annotated[float, Field(gt=0, le=1, description="weight kept by older counts at each look")] = 0.95
    threshold: Annotated[float, Field(ge=0, lt=1, description=(
        "a swap must move more than this share of its layer's activations to the faster tier"))] = 0.02
    max_swaps: Annotated[int, Field(ge=1, description="swaps applied per look, at most")] = 2

    @model_validator(mode="after")
    def _consistent(self) -> HotExperts:
        if not self.gpu_per_layer and not self.exact_share:
            raise PydanticCustomError("hot_experts", "hot_experts needs gpu_per_layer > 0 or exact_share > 0", {})
        if self.strategy == "dynamic" and self.gpu_per_layer and self.exact_share:
            raise PydanticCustomError("hot_experts", "a dynamic hot set is gpu_per_layer or exact_share, not both",
                                      {})
        if self.strategy == "frequency" and not self.stats_file:
            raise PydanticCustomError("hot_experts", "strategy frequency needs stats_file", {})
        return self


class PrecisionProfile(StrictModel):
    routed_experts: Literal["int4", "int8", "int8_a8", "bf16", "bf16_a16"] = "int4"
    formatting_layers: Annotated[int, Field(ge=0, description="last N layers kept at formatting_dtype")] = 0
    formatting_dtype: Literal["int8", "bf16", "fp32"] = "bf16"
    lm_head: Literal["int4", "int8", "int8_a8", "bf16", "bf16_a16", "fp32"] = "bf16"
    attention: Annotated[Literal["model", "int8", "int8_a8", "int4", "bf16", "bf16_a16"], Field(
        description="attention q/k/v/o projections on CPU; 'model' keeps the checkpoint's weights")] = "model"
    hot_experts: HotExperts | None = None


class SqlRules(StrictModel):
    dialect: str = Field(description=f"sqlglot dialect, one of: {', '.join(SQL_DIALECTS)}")
    read_only: bool = True
    allowed_tables: list[str] = Field(default_factory=list, description="lower-cased; `schema.table` allowed")
    row_limit: Annotated[int, Field(gt=0)] | None = 1000

    @field_validator("dialect")
    @classmethod
    def _known_dialect(cls, v: str) -> str:
        if v not in SQL_DIALECTS:
            raise PydanticCustomError("sql_dialect", "unknown SQL dialect '{d}'; known: {known}",
                                      {"d": v, "known": ", ".join(SQL_DIALECTS)})
        return v

    @field_validator("allowed_tables")
    @classmethod
    def _lower_tables(cls, v: list[str]) -> list[str]:
        return [t.lower() for t in v]


class RedactionRule(StrictModel):
    pattern: str
    replacement: str = "[REDACTED]"

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as exc:
            raise PydanticCustomError("regex", "invalid regular expression: {err}", {"err": str(exc)}) from None
        return v


class AuditSettings(StrictModel):
    level: Literal["off", "metadata", "full"] = "metadata"
    redact: list[RedactionRule] = Field(default_factory=list)
    fsync: Literal["always", "interval", "never"] = "interval"
    fsync_interval_s: Annotated[float, Field(gt=0)] = 1.0

    def redact_text(self, text: str) -> str:
        for rule in self.redact:
            text = re.sub(rule.pattern, rule.replacement, text)
        return text
