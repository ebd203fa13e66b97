"""OpenTelemetry tracing: a span per request with GenAI attributes, phase child spans, mode-switch events,
W3C traceparent propagation, and OTLP/HTTP or JSONL-file export."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

PHASES = ("policy", "classification", "constraint", "queue", "prefill", "decode", "validation", "audit")
_PROPAGATOR = TraceContextTextMapPropagator()


class JsonlSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file (the default when no OTLP endpoint is set)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in shutdown)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_to_dict(s), separators=(",", ":"), default=str) + "\n" for s in spans)
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.write(lines)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _attrs(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in (attributes or {}).items()}


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    ctx, parent = span.get_span_context(), span.parent
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent else None,
        "kind": span.kind.name,
        "start_time_unix_nano": span.start_time,
        "end_time_unix_nano": span.end_time,
        "duration_ms": (span.end_time - span.start_time) / 1e6 if span.end_time and span.start_time else None,
        "status": {"code": span.status.status_code.name, "description": span.status.description},
        "attributes": _attrs(span.attributes),
        "events": [{"name": e.name, "time_unix_nano": e.timestamp, "attributes": _attrs(e.attributes)}
                   for e in span.events],
        "resource": _attrs(span.resource.attributes),
    }


class _HeaderGetter(Getter):
    """Case-insensitive header lookup for plain dicts, Starlette Headers or lists of pairs."""

    def get(self, carrier: Any, key: str) -> list[str] | None:
        if hasattr(carrier, "getlist"):
            values = carrier.getlist(key)
            return list(values) or None
        key = key.lower()
        values = [v for k, v in (carrier.items() if hasattr(carrier, "items") else carrier) if k.lower() == key]
        return values or None

    def keys(self, carrier: Any) -> list[str]:
        return [k for k, _ in (carrier.items() if hasattr(carrier, "items") else carrier)]


def extract_context(headers: Any) -> Context:
    """The remote parent from a W3C `traceparent` (and `tracestate`) header, if any."""
    return _PROPAGATOR.extract(headers, getter=_HeaderGetter())


def inject_headers(headers: MutableMapping[str, str], context: Context | None = None) -> MutableMapping[str, str]:
    """Write `traceparent`/`tracestate` for the current (or given) context into `headers`."""
    _PROPAGATOR.inject(headers, context=context)
    return headers


def otlp_traces_url(endpoint: str) -> str:
    """`http://collector:4318` -> `http://collector:4318/v1/traces` (a full traces URL is kept as is)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


@dataclass
class RequestTrace:
    """The request span plus helpers that name moegate's attributes and events consistently."""

    span: Span
    tracer: trace.Tracer
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    output_tokens: int | None = None
    _context: Context | None = field(default=None, init=False, repr=False)  # the request span's: each phase's parent

    @property
    def trace_id(self) -> str:
        return f"{self.span.get_span_context().trace_id:032x}"

    @property
    def span_id(self) -> str:
        return f"{self.span.get_span_context().span_id:016x}"

    @contextmanager
    def phase(self, name: str, **attributes: Any) -> Iterator[Span]:
        """A child span `moegate.<name>`; phases: policy, classification, prefill, decode, validation, ..."""
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; one of {PHASES}")
        if self._context is None:
            self._context = trace.set_span_in_context(self.span)
        # not made the current span (nothing reads it; attaching costs the event loop per request): a child of
        # the request span by its context, ended and marked failed on an exception as `use_span` would
        span = self.tracer.start_span(f"moegate.{name}", context=self._context, attributes=_clean(attributes))
        try:
            yield span
        except Exception as exc:
            if span.is_recording():
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            span.end()

    def set(self, attributes: Mapping[str, Any]) -> None:
        self.span.set_attributes(_clean(attributes))

    def mode_switch(self, from_mode: str, to_mode: str, reason: str, token_index: int | None = None,
                    sequence: int | None = None) -> None:
        self.span.add_event("moegate.mode_switch", _clean({
            "moegate.mode.from": from_mode, "moegate.mode.to": to_mode, "moegate.mode.reason": reason,
            "moegate.token_index": token_index, "moegate.sequence": sequence}))

    def cache_hits(self, tiers: Sequence[str], hit_tokens: int | None = None) -> None:
        """Tiers that served prefix blocks, e.g. ["gpu", "ram"]; empty means a miss."""
        self.span.set_attributes(_clean({"moegate.cache.tiers_hit": list(tiers), "moegate.cache.hit_tokens": hit_tokens}))

    def validation(self, kind: str, ok: bool, errors: Sequence[str] = (), retries: int = 0) -> None:
        """One validation outcome (kind: json, tool_args, sql); the span keeps the last result and each as an event."""
        attrs = {"moegate.validation.kind": kind, "moegate.validation.ok": ok,
                 "moegate.validation.retries": retries, "moegate.validation.errors": list(errors)[:10]}
        self.span.add_event("moegate.validation", _clean(attrs))
        self.span.set_attributes({"moegate.validation.result": "pass" if ok else "fail",
                                  "moegate.validation.retries": retries})

    def first_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def usage(self, input_tokens: int, output_tokens: int, finish_reasons: Sequence[str] = (),
              response_id: str | None = None, response_model: str | None = None) -> None:
        self.output_tokens = output_tokens
        self.span.set_attributes(_clean({
            "gen_ai.usage.input_tokens": input_tokens, "gen_ai.usage.output_tokens": output_tokens,
            "gen_ai.response.finish_reasons": list(finish_reasons), "gen_ai.response.id": response_id,
            "gen_ai.response.model": response_model}))

    def audit_record(self, seq: int, record_hash: str) -> None:
        """Link the span to its audit record (the record carries this trace id)."""
        self.span.set_attributes({"moegate.audit.seq": seq, "moegate.audit.hash": record_hash})

    def error(self, error_type: str, message: str) -> None:
        self.span.set_attribute("error.type", error_type)
        self.span.set_status(Status(StatusCode.ERROR, message))

    def inject(self, headers: MutableMapping[str, str]) -> MutableMapping[str, str]:
        return inject_headers(headers, trace.set_span_in_context(self.span))

    def _finish(self) -> None:
        end = time.perf_counter()
        self.span.set_attribute("moegate.latency.duration_s", end - self.started)
        if self.first_token_at is not None:
            ttft = self.first_token_at - self.started
            self.span.set_attribute("moegate.latency.time_to_first_token_s", ttft)
            if self.output_tokens and self.output_tokens > 1:
                self.span.set_attribute("moegate.latency.time_per_output_token_s",
                                        (end - self.first_token_at) / (self.output_tokens - 1))


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """Drop None values (OTel rejects them) and turn sequences into lists of one primitive type."""
    out: dict[str, Any] = {}
    for k, v in attributes.items():
        if v is None:
            continue
        out[k] = [str(x) for x in v] if isinstance(v, list | tuple) and not all(
            isinstance(x, bool | int | float | str) for x in v) else (list(v) if isinstance(v, tuple) else v)
    return out


class Telemetry:
    """A tracer provider (not installed globally unless asked) with the configured exporters."""

    def __init__(self, provider: TracerProvider, service_name: str):
        self.provider = provider
        self.tracer = provider.get_tracer("moegate.gateway")
        self.service_name = service_name

    @contextmanager
    def request_span(self, headers: Any = None, *, model: str, operation: str = "chat",
                     tenant: str | None = None, policy_id: str | None = None, policy_digest: str | None = None,
                     mode: str | None = None, numerics_fingerprint: str | None = None,
                     params: Mapping[str, Any] | None = None) -> Iterator[RequestTrace]:
        """The server span for one request, a child of the caller's `traceparent` when present.
        `params` are the OpenAI sampling fields (max_tokens, temperature, top_p, seed, ...)."""
        params = params or {}
        attributes = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "moegate",
            "gen_ai.system": "moegate",
            "gen_ai.request.model": model,
            "moegate.tenant": tenant,
            "moegate.policy.id": policy_id,
            "moegate.policy.digest": policy_digest,
            "moegate.mode": mode,
            "moegate.numerics.fingerprint": numerics_fingerprint,
        }
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "frequency_penalty",
                     "presence_penalty", "stop_sequences"):
            attributes[f"gen_ai.request.{name}"] = params.get(name)
        if params.get("n") not in (None, 1):
            attributes["gen_ai.request.choice.count"] = params["n"]
        parent = extract_context(headers) if headers is not None else None
        with self.tracer.start_as_current_span(f"{operation} {model}", context=parent, kind=SpanKind.SERVER,
                                               attributes=_clean(attributes)) as span:
            rt = RequestTrace(span, self.tracer)
            try:
                yield rt
            finally:
                rt._finish()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.provider.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self.provider.shutdown()


def setup_tracing(service_name: str = "moegate", otlp_endpoint: str | None = None,
                  jsonl_path: str | Path | None = None, *, batch: bool = True,
                  set_global: bool = False, resource_attributes: Mapping[str, str] | None = None) -> Telemetry:
    """Tracing with an OTLP/HTTP exporter when `otlp_endpoint` is set and a JSONL file exporter when
    `jsonl_path` is set (the gateway passes a default path, so JSONL is on unless disabled).
    `batch=False` exports synchronously at span end (tests, CLI tools)."""
    resource = Resource.create({"service.name": service_name, **(resource_attributes or {})})
    provider = TracerProvider(resource=resource)
    processor = BatchSpanProcessor if batch else SimpleSpanProcessor
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(processor(OTLPSpanExporter(endpoint=otlp_traces_url(otlp_endpoint))))
    if jsonl_path is not None:
        provider.add_span_processor(processor(JsonlSpanExporter(jsonl_path)))
    if set_global:
        trace.set_tracer_provider(provider)
    return Telemetry(provider, service_name)
