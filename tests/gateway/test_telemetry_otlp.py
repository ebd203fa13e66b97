"""OTLP/HTTP export to a local collector stand-in: spans arrive with their GenAI and moegate attributes."""

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from gateway.telemetry import otlp_traces_url, setup_tracing

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class _Collector(BaseHTTPRequestHandler):
    received: list  # (path, content-type, ExportTraceServiceRequest)

    def do_POST(self):  # noqa: N802 (http.server API)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        self.received.append((self.path, self.headers.get("Content-Type"), req))
        payload = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind)


def test_spans_arrive_at_otlp_collector():
    _Collector.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        tel = setup_tracing("moegate-otlp", otlp_endpoint=f"http://127.0.0.1:{server.server_port}")
        with tel.request_span({"traceparent": TRACEPARENT}, model="qwen3-moe", tenant="risk",
                              policy_id="finance-prod", numerics_fingerprint="nf-9",
                              params={"max_tokens": 32}) as rt:
            with rt.phase("decode"):
                rt.mode_switch("exploration", "execution", reason="tool_call", token_index=3)
            rt.usage(input_tokens=10, output_tokens=5, finish_reasons=["tool_calls"])
        assert tel.force_flush(10000)
        tel.shutdown()
    finally:
        server.shutdown()
        server.server_close()
    assert _Collector.received, "the collector received nothing"
    path, content_type, _ = _Collector.received[0]
    assert path == "/v1/traces" and content_type == "application/x-protobuf"
    spans = [(rs, s) for _, _, req in _Collector.received for rs in req.resource_spans
             for ss in rs.scope_spans for s in ss.spans]
    by_name = {s.name: (rs, s) for rs, s in spans}
    rs, root = by_name["chat qwen3-moe"]
    assert root.trace_id.hex() == "4bf92f3577b34da6a3ce929d0e0e4736" and root.parent_span_id.hex() == "00f067aa0ba902b7"
    attrs = {a.key: _value(a.value) for a in root.attributes}
    assert attrs["gen_ai.request.model"] == "qwen3-moe" and attrs["gen_ai.request.max_tokens"] == 32
    assert attrs["gen_ai.usage.input_tokens"] == 10 and attrs["gen_ai.usage.output_tokens"] == 5
    assert attrs["gen_ai.response.finish_reasons"] == ["tool_calls"]
    assert attrs["moegate.tenant"] == "risk" and attrs["moegate.numerics.fingerprint"] == "nf-9"
    resource = {a.key: _value(a.value) for a in rs.resource.attributes}
    assert resource["service.name"] == "moegate-otlp"
    _, decode = by_name["moegate.decode"]
    assert decode.parent_span_id == root.span_id
    event = next(e for e in root.events if e.name == "moegate.mode_switch")
    assert {a.key: _value(a.value) for a in event.attributes}["moegate.mode.reason"] == "tool_call"


def test_otlp_url():
    assert otlp_traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert otlp_traces_url("http://c:4318/v1/traces/") == "http://c:4318/v1/traces"
