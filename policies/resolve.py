"""Policy resolution: tenant + route + model -> the ResolvedPolicy one request runs under."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from engine.mode import Mode

if TYPE_CHECKING:
    from policies.model import AuditSettings, Limits, Policy, PrecisionProfile, SqlRules, Tenant


class PolicyDenied(Exception):
    """The policy does not allow this request. `reason` is one of: tenant, route, model, tool, database."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ResolvedPolicy:
    policy_id: str
    policy_digest: str
    tenant_id: str
    route: str
    model: str
    execution_when: frozenset[str]
    segments: Mapping[str, Mode]  # segment kind -> mode
    allowed_tools: frozenset[str]  # contains "*" when every tool is allowed
    sql: Mapping[str, SqlRules]  # database name -> rules
    precision: Mapping[Mode, str]  # precision profile name
    precision_profiles: Mapping[Mode, PrecisionProfile]
    deferral_depth: Mapping[Mode, int]  # execution is always 0
    temperature: Mapping[Mode, float]  # temperature of requests that send none
    limits: Limits
    audit: AuditSettings
    audit_level: Literal["off", "metadata", "full"]
    on_unavailable: Literal["fail_open", "fail_closed"]
    idempotency_ttl_s: int
    idempotency_wait_s: float

    def is_execution(self, features: Iterable[str]) -> bool:
        """True when the request's structural features (json_schema, json_object, tools_required,
        tools_any, sql) or the `always` rule make the whole request execution."""
        return "always" in self.execution_when or bool(self.execution_when & set(features))

    def segment_mode(self, kind: str) -> Mode:
        """Mode for a segment detected in an exploration response (unknown kinds stay exploration)."""
        return self.segments.get(kind, Mode.EXPLORATION)

    def tool_allowed(self, name: str) -> bool:
        return "*" in self.allowed_tools or name in self.allowed_tools

    def check_tools(self, names: Iterable[str]) -> None:
        denied = sorted(n for n in names if not self.tool_allowed(n))
        if denied:
            raise PolicyDenied("tool", f"tenant {self.tenant_id!r} may not use tools {denied}; "
                                       f"allowed: {sorted(self.allowed_tools)}")

    def sql_rules(self, database: str) -> SqlRules:
        if database not in self.sql:
            raise PolicyDenied("database", f"tenant {self.tenant_id!r} may not query database {database!r}; "
                                           f"allowed: {sorted(self.sql)}")
        return self.sql[database]

    def redact(self, text: str) -> str:
        return self.audit.redact_text(text)


def resolve(policy: Policy, tenant: Tenant | str, route: str, model: str) -> ResolvedPolicy:
    if isinstance(tenant, str):
        found = policy.tenant(tenant)
        if found is None:
            raise PolicyDenied("tenant", f"unknown tenant {tenant!r}")
        tenant = found
    route_rule = next((r for r in policy.routes if r.path == route), None)
    if route_rule is None or ("*" not in tenant.routes and route not in tenant.routes):
        raise PolicyDenied("route", f"route {route!r} is not enabled for tenant {tenant.id!r}")
    known = {m.name for m in policy.models}
    route_ok = route_rule.models is None or model in route_rule.models
    tenant_ok = "*" in tenant.models or model in tenant.models
    if model not in known or not route_ok or not tenant_ok:
        allowed = sorted(m for m in known if (route_rule.models is None or m in route_rule.models)
                         and ("*" in tenant.models or m in tenant.models))
        raise PolicyDenied("model", f"model {model!r} is not available to tenant {tenant.id!r} on {route}; "
                                    f"available: {allowed}")
    rules = route_rule.modes or policy.modes
    modes = policy.modes
    return ResolvedPolicy(
        policy_id=policy.id,
        policy_digest=policy.digest,
        tenant_id=tenant.id,
        route=route,
        model=model,
        execution_when=frozenset(rules.execution_when),
        segments=dict(rules.segments),
        allowed_tools=frozenset(tenant.allowed_tools),
        sql={d: policy.databases[d] for d in tenant.databases},
        precision={m: getattr(modes, m).precision for m in Mode},
        precision_profiles={m: policy.precision_profiles[getattr(modes, m).precision] for m in Mode},
        deferral_depth={Mode.EXPLORATION: modes.exploration.deferral_depth, Mode.EXECUTION: 0},
        temperature={m: getattr(modes, m).default_temperature(m) for m in Mode},
        limits=policy.limits.overlay(route_rule.limits).overlay(tenant.limits),
        audit=policy.audit,
        audit_level=tenant.audit_level or policy.audit.level,
        on_unavailable=policy.stores.on_unavailable,
        idempotency_ttl_s=policy.stores.idempotency_ttl_s,
        idempotency_wait_s=policy.stores.idempotency_wait_s,
    )
