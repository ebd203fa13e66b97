"""Pydantic v2 policy model: tenants, models, routes, modes, tools, SQL rules, precision, limits, audit."""

from __future__ import annotations

import hashlib
import json
import re
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError
from sqlglot.dialects.dialect import Dialects

from engine.mode import Mode
from policies.resolve import ResolvedPolicy, resolve

# engine.mode.Mode in policy files: the schema and its errors list the plain words; values become Mode members.
PolicyMode = Annotated[Literal[tuple(m.value for m in Mode)], AfterValidator(Mode)]
ExecutionTrigger = Literal["json_schema", "json_object", "tools_required", "tools_any", "sql", "always"]
SegmentKind = Literal["json_fence", "sql_fence", "tool_call"]
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/@+-]*$", max_length=200)]
KEY_HASH_PATTERN = r"^sha256:[0-9a-f]{64}$"
SQL_DIALECTS = sorted(d.value for d in Dialects if d.value)


def hash_api_key(api_key: str) -> str:
    """The stored form of an API key: `sha256:<hex>` (keys are high-entropy secrets, so no salt)."""
    return "sha256:" + hashlib.sha256(api_key.encode("utf-8")).hexdigest()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ApiKey(_Strict):
    hash: Annotated[str, Field(pattern=KEY_HASH_PATTERN, description="`sha256:<hex>` of the key")]
    name: str = ""


class Limits(_Strict):
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


class ModeSettings(_Strict):
    precision: Annotated[str, Field(description="name of a precision profile")]
    deferral_depth: Annotated[int, Field(ge=0, le=16)] | Literal["auto"] = Field(0, description=(
        "routed experts deferred per token (their output joins the next layer's); `auto`: defer where the "
        "dense path runs on a GPU and the CPU experts overlap with it, not on a CPU-only machine, where "
        "experts and dense path share the cores and deferral measured as a loss"))
    temperature: Annotated[float, Field(ge=0, le=2, description=(
        "sampling temperature of requests in this mode that send none; unset: 0 (greedy) in execution, "
        "1 (OpenAI's default) in exploration"))] | None = None

    def default_temperature(self, mode: Mode) -> float:
        if self.temperature is not None:
            return self.temperature
        return 0.0 if mode == Mode.EXECUTION else 1.0


class ModeRules(_Strict):
    execution_when: list[ExecutionTrigger] = Field(
        default_factory=lambda: ["json_schema", "json_object", "tools_required", "sql"],
        description="request features that make the whole request execution; `always` forces it",
    )
    segments: dict[SegmentKind, PolicyMode] = Field(
        default_factory=lambda: {"json_fence": Mode.EXECUTION, "sql_fence": Mode.EXECUTION, "tool_call": Mode.EXECUTION},
        description="mode of a segment detected inside an exploration response",
    )


class Modes(ModeRules):
    exploration: ModeSettings
    execution: ModeSettings

    @model_validator(mode="after")
    def _no_deferral_in_execution(self) -> Modes:
        if self.execution.deferral_depth != 0:
            raise ValidationError.from_exception_data("Modes", [InitErrorDetails(
                type=PydanticCustomError("execution_deferral",
                                         "execution mode must not defer experts: set deferral_depth to 0"),
                loc=("execution", "deferral_depth"), input=self.execution.deferral_depth)])
        return self


class HotExperts(_Strict):
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


class PrecisionProfile(_Strict):
    routed_experts: Literal["int4", "int8", "bf16"] = "int4"
    formatting_layers: Annotated[int, Field(ge=0, description="last N layers kept at formatting_dtype")] = 0
    formatting_dtype: Literal["int8", "bf16", "fp32"] = "bf16"
    lm_head: Literal["int4", "int8", "bf16", "fp32"] = "bf16"
    attention: Annotated[Literal["model", "int8", "int4", "bf16"], Field(
        description="attention q/k/v/o projections on CPU; 'model' keeps the checkpoint's weights")] = "model"
    hot_experts: HotExperts | None = None


class SqlRules(_Strict):
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


class RedactionRule(_Strict):
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


class AuditSettings(_Strict):
    level: Literal["off", "metadata", "full"] = "metadata"
    redact: list[RedactionRule] = Field(default_factory=list)
    fsync: Literal["always", "interval", "never"] = "interval"
    fsync_interval_s: Annotated[float, Field(gt=0)] = 1.0

    def redact_text(self, text: str) -> str:
        for rule in self.redact:
            text = re.sub(rule.pattern, rule.replacement, text)
        return text


class StoreSettings(_Strict):
    on_unavailable: Literal["fail_open", "fail_closed"] = "fail_closed"
    timeout_s: Annotated[float, Field(gt=0, le=30, description="socket timeout of each redis call (opening a connection: at least 2 s)")] = 0.5
    circuit_failures: Annotated[int, Field(ge=1, description=(
        "consecutive redis failures or timeouts that open the circuit (redis is then not called, "
        "on_unavailable applies)"))] = 3
    circuit_cooldown_s: Annotated[float, Field(gt=0, description=(
        "seconds the circuit stays open before one call probes redis"))] = 5.0
    idempotency_ttl_s: Annotated[int, Field(gt=0)] = 86400
    idempotency_wait_s: Annotated[float, Field(ge=0)] = 30.0


class DecodingSettings(_Strict):
    """Multi-token decoding (the engine's jump-forward and prompt-lookup speculation); fixed at start."""

    jump_forward_tokens: Annotated[int, Field(ge=0, le=256, description=(
        "constrained execution output: tokens the grammar forces (the only token its mask allows) appended per "
        "step without a forward each, their KV computed in one chunk; the bytes equal token-by-token decoding. "
        "0: off"))] = 32
    speculative_tokens: Annotated[int, Field(ge=0, le=16, description=(
        "unconstrained output: tokens drafted per step by matching the last tokens earlier in prompt and output, "
        "verified in one forward (greedy keeps the agreeing prefix; sampling keeps the output distribution). "
        "Pays only on repetitive output (echoed tables, quoted text); 0: off"))] = 0
    speculative_ngram: Annotated[int, Field(ge=1, le=8, description=(
        "longest tail (tokens) matched to find drafts; shorter ones down to 1 are tried next"))] = 3


class ModelEntry(_Strict):
    name: Name
    source: str | None = Field(None, description="checkpoint directory (a relative path is read from the policy "
                                                  "file's folder) or `builtin:<name>`; what `moegate serve` loads")
    description: str = ""


class Route(_Strict):
    path: Annotated[str, Field(pattern=r"^/")]
    models: list[str] | None = Field(None, description="models served on this route; null = all")
    modes: ModeRules | None = None
    limits: Limits | None = None


class Tenant(_Strict):
    id: Name
    api_keys: list[ApiKey] = Field(min_length=1)
    models: list[str] = Field(default_factory=lambda: ["*"], description="model names, or `*`")
    routes: list[str] = Field(default_factory=lambda: ["*"], description="route paths, or `*`")
    allowed_tools: list[str] = Field(default_factory=list, description="tool names, or `*`")
    databases: list[str] = Field(default_factory=list, description="names from `databases`")
    limits: Limits | None = None
    audit_level: Literal["off", "metadata", "full"] | None = None


class Policy(_Strict):
    version: Literal[1] = 1
    id: Name
    description: str = ""
    models: list[ModelEntry] = Field(min_length=1)
    routes: list[Route] = Field(min_length=1)
    tenants: list[Tenant] = Field(min_length=1)
    modes: Modes
    precision_profiles: dict[str, PrecisionProfile] = Field(min_length=1)
    databases: dict[str, SqlRules] = Field(default_factory=dict)
    limits: Limits = Field(default_factory=Limits)
    audit: AuditSettings = Field(default_factory=AuditSettings)
    stores: StoreSettings = Field(default_factory=StoreSettings)
    decoding: DecodingSettings = Field(default_factory=DecodingSettings)

    @model_validator(mode="after")
    def _references(self) -> Policy:
        problems: list[tuple[tuple[str | int, ...], str, Any]] = []
        model_names = {m.name for m in self.models}
        route_paths = {r.path for r in self.routes}

        def dup(items: list[str], where: str, field: str) -> None:
            seen: set[str] = set()
            for i, item in enumerate(items):
                if item in seen:
                    problems.append(((where, i, field), f"duplicate {field} {item!r}", item))
                seen.add(item)

        dup([m.name for m in self.models], "models", "name")
        dup([r.path for r in self.routes], "routes", "path")
        dup([t.id for t in self.tenants], "tenants", "id")
        key_owner: dict[str, str] = {}
        for mode in Mode:
            name = getattr(self.modes, mode).precision
            if name not in self.precision_profiles:
                problems.append((("modes", mode, "precision"),
                                 f"unknown precision profile {name!r}; defined: {sorted(self.precision_profiles)}",
                                 name))
        exact = self.precision_profiles.get(self.modes.execution.precision)
        if exact is not None and exact.hot_experts is not None and exact is not self.precision_profiles.get(
                self.modes.exploration.precision):
            problems.append((("precision_profiles", self.modes.execution.precision, "hot_experts"),
                             "hot experts apply to exploration only: execution's numerics must not follow the "
                             "traffic", None))
        for ri, route in enumerate(self.routes):
            for mi, m in enumerate(route.models or []):
                if m not in model_names:
                    problems.append((("routes", ri, "models", mi), f"unknown model {m!r}", m))
        for ti, t in enumerate(self.tenants):
            for ki, key in enumerate(t.api_keys):
                if key.hash in key_owner:
                    problems.append((("tenants", ti, "api_keys", ki, "hash"),
                                     f"API key already belongs to tenant {key_owner[key.hash]!r}", key.hash))
                key_owner[key.hash] = t.id
            for mi, m in enumerate(t.models):
                if m != "*" and m not in model_names:
                    problems.append((("tenants", ti, "models", mi), f"unknown model {m!r}", m))
            for pi, p in enumerate(t.routes):
                if p != "*" and p not in route_paths:
                    problems.append((("tenants", ti, "routes", pi), f"unknown route {p!r}", p))
            for di, d in enumerate(t.databases):
                if d not in self.databases:
                    problems.append((("tenants", ti, "databases", di), f"unknown database {d!r}", d))
        if problems:
            raise ValidationError.from_exception_data(
                "Policy",
                [InitErrorDetails(type=PydanticCustomError("policy_reference", msg), loc=loc, input=value)
                 for loc, msg, value in problems],
            )
        return self

    @cached_property
    def digest(self) -> str:
        """sha256 over the canonical JSON of the policy: identifies this exact version in audit and traces."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()

    @cached_property
    def _tenant_by_key(self) -> dict[str, Tenant]:
        return {k.hash: t for t in self.tenants for k in t.api_keys}

    def authenticate(self, api_key: str) -> Tenant | None:
        """The tenant owning `api_key`, or None."""
        if not api_key:
            return None
        return self._tenant_by_key.get(hash_api_key(api_key))

    def tenant(self, tenant_id: str) -> Tenant | None:
        return next((t for t in self.tenants if t.id == tenant_id), None)

    def resolve(self, tenant: Tenant | str, route: str, model: str) -> ResolvedPolicy:
        """Everything the gateway needs for one request; raises PolicyDenied when not allowed."""
        return resolve(self, tenant, route, model)

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        schema = cls.model_json_schema()
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["title"] = "moegate policy"
        return schema
