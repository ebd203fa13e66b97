"""Pydantic v2 policy model: tenants, models, routes, modes, tools, SQL rules, precision, limits, audit."""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from engine.mode import Mode
from policies.resolve import PolicyDenied, ResolvedPolicy
from policies.sections import SQL_DIALECTS as SQL_DIALECTS
from policies.sections import AuditSettings as AuditSettings
from policies.sections import HotExperts as HotExperts
from policies.sections import Limits as Limits
from policies.sections import PrecisionProfile as PrecisionProfile
from policies.sections import RedactionRule as RedactionRule
from policies.sections import SqlRules as SqlRules
from policies.sections import StrictModel as _Strict

# engine.mode.Mode in policy files: the schema and its errors list the plain words; values become Mode members.
PolicyMode = Annotated[Literal[tuple(m.value for m in Mode)], AfterValidator(Mode)]
ExecutionTrigger = Literal["json_schema", "json_object", "tools_required", "tools_any", "sql", "always"]
SegmentKind = Literal["json_fence", "sql_fence", "tool_call"]
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/@+-]*$", max_length=200)]
KEY_HASH_PATTERN = r"^sha256:[0-9a-f]{64}$"


def hash_api_key(api_key: str) -> str:
    """The stored form of an API key: `sha256:<hex>` (keys are high-entropy secrets, so no salt)."""
    return "sha256:" + hashlib.sha256(api_key.encode("utf-8")).hexdigest()


class ApiKey(_Strict):
    hash: Annotated[str, Field(pattern=KEY_HASH_PATTERN, description="`sha256:<hex>` of the key")]
    name: str = ""


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
    speculative_source: Literal["ngram", "mtp"] = Field("ngram", description=(
        "where drafts come from: `ngram` (prompt lookup) or `mtp` (the checkpoint's multi-token-prediction layer, "
        "DeepSeek-V3 / GLM-4.5: loaded only then; a checkpoint without one fails at startup). Either way drafts "
        "are verified, so output is the same"))


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
        if isinstance(tenant, str):
            found = self.tenant(tenant)
            if found is None:
                raise PolicyDenied("tenant", f"unknown tenant {tenant!r}")
            tenant = found
        route_rule = next((r for r in self.routes if r.path == route), None)
        if route_rule is None or ("*" not in tenant.routes and route not in tenant.routes):
            raise PolicyDenied("route", f"route {route!r} is not enabled for tenant {tenant.id!r}")
        known = {m.name for m in self.models}
        route_ok = route_rule.models is None or model in route_rule.models
        tenant_ok = "*" in tenant.models or model in tenant.models
        if model not in known or not route_ok or not tenant_ok:
            allowed = sorted(m for m in known if (route_rule.models is None or m in route_rule.models)
                             and ("*" in tenant.models or m in tenant.models))
            raise PolicyDenied("model", f"model {model!r} is not available to tenant {tenant.id!r} on {route}; "
                                        f"available: {allowed}")
        rules = route_rule.modes or self.modes
        modes = self.modes
        return ResolvedPolicy(
            policy_id=self.id,
            policy_digest=self.digest,
            tenant_id=tenant.id,
            route=route,
            model=model,
            execution_when=frozenset(rules.execution_when),
            segments=dict(rules.segments),
            allowed_tools=frozenset(tenant.allowed_tools),
            sql={d: self.databases[d] for d in tenant.databases},
            precision={m: getattr(modes, m).precision for m in Mode},
            precision_profiles={m: self.precision_profiles[getattr(modes, m).precision] for m in Mode},
            deferral_depth={Mode.EXPLORATION: modes.exploration.deferral_depth, Mode.EXECUTION: 0},
            temperature={m: getattr(modes, m).default_temperature(m) for m in Mode},
            limits=self.limits.overlay(route_rule.limits).overlay(tenant.limits),
            audit=self.audit,
            audit_level=tenant.audit_level or self.audit.level,
            on_unavailable=self.stores.on_unavailable,
            idempotency_ttl_s=self.stores.idempotency_ttl_s,
            idempotency_wait_s=self.stores.idempotency_wait_s,
        )

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        schema = cls.model_json_schema()
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["title"] = "moegate policy"
        return schema
