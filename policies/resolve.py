"""What one request runs under: `ResolvedPolicy` (made by `Policy.resolve`: tenant + route + model), `PolicyDenied`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from engine.mode import Mode
from policies.sections import AuditSettings, Limits, PrecisionProfile, SqlRules


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
