"""Typed errors of structured decoding; the gateway turns each into an HTTP 400 with its message."""

from __future__ import annotations


class StructuredOutputError(Exception):
    """Base class: a request whose structure constraint cannot be honoured. Maps to HTTP 400."""

    http_status = 400
    code = "structured_output_error"
    validations: tuple = ()  # gateway.retry.Validation outcomes of the request's attempts, set by the gateway

    def to_dict(self) -> dict:
        return {"type": "invalid_request_error", "code": self.code, "message": str(self)}


class UnsupportedSchemaError(StructuredOutputError):
    """A JSON Schema keyword (or value) the chosen backend cannot enforce; never silently dropped."""

    code = "unsupported_schema_feature"

    def __init__(self, keyword: str, path: str, detail: str = "", backend: str = "") -> None:
        self.keyword, self.path, self.detail, self.backend = keyword, path or "#", detail, backend
        by = f" by the {backend} backend" if backend else ""
        more = f" ({detail})" if detail else ""
        super().__init__(
            f"JSON Schema keyword '{keyword}' at {self.path} cannot be enforced{by}{more}; "
            "remove it or rewrite the schema with supported keywords (type, properties, required, "
            "additionalProperties, items, prefixItems, enum, const, anyOf, allOf, $ref, min/max "
            "Length/Items/imum, pattern, known formats)."
        )


class ConstraintCompileTimeout(StructuredOutputError):
    """Compiling the constraint took longer than the configured bound."""

    code = "constraint_compile_timeout"

    def __init__(self, kind: str, timeout_s: float) -> None:
        self.kind, self.timeout_s = kind, timeout_s
        super().__init__(
            f"compiling the {kind} constraint exceeded {timeout_s:g} s; simplify it (fewer "
            "alternatives, shorter patterns, fewer tools) or split the request."
        )


class ConstraintCompileError(StructuredOutputError):
    """The constraint is malformed (bad regex, bad grammar, invalid schema document)."""

    code = "invalid_constraint"

    def __init__(self, kind: str, detail: str) -> None:
        self.kind, self.detail = kind, detail
        super().__init__(f"the {kind} constraint could not be compiled: {detail}")


class UnknownBackendError(StructuredOutputError):
    code = "unknown_constraint_backend"

    def __init__(self, name: str, kind: str, available: list[str]) -> None:
        super().__init__(f"no constraint backend '{name}' for {kind}; available: {', '.join(available)}")


class SQLPolicyViolation(StructuredOutputError):
    """A SQL statement breaks a policy rule (read-only, known columns, functions, LIMIT...)."""

    code = "sql_policy_violation"

    def __init__(self, rule: str, detail: str) -> None:
        self.rule, self.detail = rule, detail
        super().__init__(f"SQL rejected by rule '{rule}': {detail}")


class StructuredValidationError(StructuredOutputError):
    """A decoded output failed validation (jsonschema / tool schema / SQL parse)."""

    code = "structured_output_invalid"

    def __init__(self, kind: str, detail: str, path: str = "") -> None:
        self.kind, self.detail, self.path = kind, detail, path
        at = f" at {path}" if path else ""
        super().__init__(f"{kind} output failed validation{at}: {detail}")


class ToolCallParseError(StructuredValidationError):
    def __init__(self, detail: str) -> None:
        super().__init__("tool_call", detail)
