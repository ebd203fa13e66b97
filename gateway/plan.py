"""One request's plan: prompt, sampling, classification, the constraint to apply and how to validate."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.mode import Mode
from engine.sampling_params import MIN_TEMPERATURE
from gateway.classify import Decision, classify, request_features
from gateway.errors import APIError, bad_request
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.structured.base import ConstraintSpec
from gateway.structured.build import json_schema_spec
from gateway.structured.errors import StructuredOutputError
from gateway.structured.sql_grammar import sql_spec
from gateway.structured.sql_schema import DIALECTS, DatabaseSchema, SQLPolicy
from gateway.structured.tool_formats import DEFAULT, ToolFormat
from gateway.structured.tools import tool_call_spec
from gateway.structured.validate import validate_json, validate_sql, validate_tool_calls
from gateway.structured.vocab import TokenizerInfo
from policies.resolve import PolicyDenied, ResolvedPolicy

MIN_TOP_P = 1e-6  # below this (or engine's MIN_TEMPERATURE), sampling is greedy


@dataclass
class Plan:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    logit_bias: dict[int, float]
    n: int
    decision: Decision  # the request's mode
    features: set[str]
    segment_modes: dict[str, Mode]
    # whole-request execution: the constraint and the validator of the complete output
    kind: str | None = None  # json | tool_calls | sql
    spec: ConstraintSpec | None = None
    validate: Callable[[str], Any] | None = None
    # tools, for tool-call segments in exploration and for the response
    tools: list[dict] = field(default_factory=list)
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    tool_format: ToolFormat = DEFAULT  # the model family's tool-call wire format
    policy: ResolvedPolicy | None = None

    @property
    def cache_salt(self) -> str:
        """Prefix-cache scope: the tenant (set by the server, never by the client)."""
        return self.policy.tenant_id if self.policy is not None else ""

    @property
    def execution(self) -> bool:
        return self.decision.mode == Mode.EXECUTION

    def sampling_fields(self) -> dict:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k or None, "seed": self.seed, "n": self.n, "stop_sequences": self.stop or None}


def _common(body: ChatCompletionRequest | CompletionRequest, vocab_size: int, default_temperature: float) -> dict:
    """Sampling fields of the request; `default_temperature` (the policy's, for the request's mode) when it
    sends none."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise bad_request(f"{name} is not supported by this engine; omit it or send 0", name, "unsupported_parameter")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            tid = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= tid < vocab_size:
            raise bad_request(f"logit_bias token id {tid} is outside the vocabulary [0, {vocab_size})", "logit_bias")
        bias[tid] = float(value)
    temperature = default_temperature if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    if temperature < MIN_TEMPERATURE or top_p < MIN_TOP_P:
        # Same distribution as greedy (only the top token survives), without the float overflow/underflow
        # that such values cause in fp32 sampling.
        temperature, top_p = 0.0, 1.0
    return {"temperature": temperature, "top_p": top_p, "top_k": body.top_k or 0, "seed": body.seed,
            "stop": body.stop_list(), "logit_bias": bias, "n": body.n}


def sql_target(fmt, rp: ResolvedPolicy) -> tuple[DatabaseSchema, SQLPolicy]:
    """The SQL extension: the caller's tables + dialect; a named policy database adds its rules."""
    tables = fmt.tables
    if any(not cols for cols in tables.values()):
        raise bad_request("every table in response_format.sql.tables needs at least one column",
                          "response_format.sql.tables")
    schema = DatabaseSchema.from_mapping(tables)
    dialect = fmt.dialect or "sqlite"
    if fmt.database is not None:
        rules = rp.sql_rules(fmt.database)  # PolicyDenied('database') -> 403
        if fmt.dialect is not None and fmt.dialect != rules.dialect:
            raise bad_request(f"database {fmt.database!r} is {rules.dialect}, the request says {fmt.dialect}",
                              "response_format.sql.dialect")
        dialect = rules.dialect
        allowed = tuple(rules.allowed_tables) or None
        return schema, SQLPolicy(dialect=_dialect(dialect), max_limit=rules.row_limit, allowed_tables=allowed)
    if rp.sql:
        raise bad_request(f"tenant {rp.tenant_id!r} must name one of its databases {sorted(rp.sql)} in "
                          "response_format.sql.database", "response_format.sql.database")
    return schema, SQLPolicy(dialect=_dialect(dialect))


def _dialect(name: str) -> str:
    if name not in DIALECTS:
        raise bad_request(f"SQL dialect {name!r} is not supported; one of {', '.join(DIALECTS)}",
                          "response_format.sql.dialect")
    return name


def chat_plan(body: ChatCompletionRequest, prompt_ids: list[int], rp: ResolvedPolicy, tok: TokenizerInfo,
              vocab_size: int, max_tokens: int, tool_format: ToolFormat = DEFAULT) -> Plan:
    if body.logprobs or body.top_logprobs:
        raise bad_request("logprobs are not supported", "logprobs", "unsupported_parameter")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise bad_request("send max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    if body.tool_choice is not None and not tools and body.tool_choice != "none":
        raise bad_request("tool_choice needs tools", "tool_choice")
    if body.parallel_tool_calls is not None and not tools:
        raise bad_request("parallel_tool_calls needs tools", "parallel_tool_calls")
    if tools:
        rp.check_tools([t["function"]["name"] for t in tools])  # PolicyDenied('tool') -> 403
    choice = body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice
    if isinstance(choice, dict) and choice["function"]["name"] not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names {choice['function']['name']!r}, which is not among the tools",
                          "tool_choice")
    fmt = body.response_format
    fmt_type = fmt.type if fmt is not None and fmt.type != "text" else None
    if fmt_type and tools and choice not in (None, "none"):
        raise bad_request("response_format and tools cannot both constrain the output; use tool_choice='none' "
                          "or drop response_format", "response_format")
    features = request_features(response_format=fmt_type, tools=bool(tools),
                                tool_choice=choice if not isinstance(choice, dict) else "named")
    decision = classify(features, rp.execution_when)
    if tools and choice != "none" and tool_format.segment_open is None and decision.mode != Mode.EXECUTION:
        # no single token opens this format's calls inside free text: the turn is constrained as a whole
        decision = Decision(Mode.EXECUTION, f"tool_format:{tool_format.name}")
    plan = Plan(prompt_ids=prompt_ids, max_tokens=max_tokens, decision=decision, features=features,
                segment_modes=dict(rp.segments), tools=tools, tool_choice=choice,
                parallel_tool_calls=True if body.parallel_tool_calls is None else body.parallel_tool_calls,
                tool_format=tool_format, policy=rp, **_common(body, vocab_size, rp.temperature[decision.mode]))
    if plan.execution and plan.stop:
        raise bad_request("stop cannot be combined with a structured output (it would cut it)", "stop")
    try:
        if fmt_type in ("json_schema", "json_object"):
            schema = (fmt.json_schema.schema_ if fmt.json_schema is not None else None) if fmt_type == "json_schema" \
                else {"type": "object"}
            if schema is None:
                schema = {}
            plan.kind, plan.spec = "json", _json_spec(schema, tool_format, tok)
            plan.validate = lambda text: validate_json(tool_format.content(text), schema)
        elif fmt_type == "sql":
            if tool_format.channels() is not None:
                raise bad_request(f"response_format sql is not supported for the {tool_format.name} format (the "
                                  "SQL guard follows a whole output, not a channel); use json_schema, or the "
                                  "moegate.sql extension in free text", "response_format")
            db, sql_policy = sql_target(fmt.sql, rp)
            plan.kind, plan.spec = "sql", sql_spec(db, sql_policy)
            plan.validate = lambda text: validate_sql(text, db, sql_policy)
        elif plan.execution and tools and choice != "none":
            plan.kind = "tool_calls"
            plan.spec = tool_call_spec(tools, tok, choice or "auto", plan.parallel_tool_calls, tool_format)
            plan.validate = lambda text: validate_tool_calls(text, tools, choice or "auto", plan.parallel_tool_calls,
                                                             tool_format)
    except StructuredOutputError as e:
        raise APIError(e.http_status, str(e), param="response_format" if fmt_type else "tools", code=e.code) from None
    if plan.execution and plan.spec is None:  # the policy forces execution on an unstructured request
        plan.kind = "text"
    return plan


def _json_spec(schema, fmt: ToolFormat, tok: TokenizerInfo) -> ConstraintSpec:
    """The whole-output JSON constraint, inside the family's envelope where its turn wraps the value."""
    envelope = fmt.json_envelope(tok)
    if not envelope:
        return json_schema_spec(schema)
    starts = tuple(tok.added_ids[t] for t in fmt.json_starts if t in tok.added_ids)
    return json_schema_spec(schema, envelope, starts)


def completion_plan(body: CompletionRequest, prompt_ids: list[int], rp: ResolvedPolicy, vocab_size: int,
                    max_tokens: int) -> Plan:
    for name, ok in (("echo", not body.echo), ("suffix", body.suffix is None), ("logprobs", body.logprobs is None),
                     ("best_of", body.best_of in (None, 1))):
        if not ok:
            raise bad_request(f"{name} is not supported", name, "unsupported_parameter")
    decision = classify(set(), rp.execution_when)
    plan = Plan(prompt_ids=prompt_ids, max_tokens=max_tokens, decision=decision, features=set(),
                segment_modes=dict(rp.segments), policy=rp,
                **_common(body, vocab_size, rp.temperature[decision.mode]))
    if plan.execution:
        plan.kind = "text"
    return plan


def policy_error(e: PolicyDenied) -> APIError:
    status = 404 if e.reason == "model" else 403
    return APIError(status, str(e), code="model_not_found" if status == 404 else f"{e.reason}_not_allowed",
                    param="model" if e.reason == "model" else None)


def dumps_args(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)
