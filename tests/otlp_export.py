"""Sends GenAI spans to a running combee with the real OpenTelemetry Python SDK
and its OTLP/HTTP (protobuf) exporter, exactly as an instrumented agent would.

Usage: otlp_export.py PROMPT VERSION N

The exporter is configured only through the standard environment variables,
as docs/opentelemetry.md shows: OTEL_EXPORTER_OTLP_ENDPOINT (combee's base URL + /v1/otlp),
OTEL_EXPORTER_OTLP_HEADERS (Authorization=Bearer%20cmb_...) and
OTEL_EXPORTER_OTLP_COMPRESSION=gzip.

Each of the N agent runs is one trace: an `invoke_agent` root span carrying the
prompt name, version and feedback, a `chat` span with the GenAI message
attributes and token usage, and an `execute_tool` span. As in a long agent run
whose spans the BatchSpanProcessor flushes while it is still going, each trace
arrives in three exports: the chat span alone, the tool span alone (neither
names the prompt), then the root span; combee merges them into one trace. One
extra span is no GenAI span and names no prompt, so combee must reject it in
`partial_success` (the exporter still reports success). Prints {"trace_ids": [...], "exports": k, "ok": bool} and
exits 0 only when every export succeeded.
"""

import json
import sys

try:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult
except ImportError as e:  # pragma: no cover - reported to the Rust test
    sys.stderr.write(
        f"MISSING PYTHON PACKAGE: {e}. Run scripts/test, which installs "
        "opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http (pinned).\n"
    )
    sys.exit(3)


class RecordingExporter(OTLPSpanExporter):
    """The real exporter, remembering each export's result."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.results = []

    def export(self, spans):
        result = super().export(spans)
        self.results.append(result)
        return result


def main():
    prompt, version, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    exporter = RecordingExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "otel-acceptance"}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    tracer = provider.get_tracer("combee-acceptance")

    trace_ids = []
    for i in range(n):
        with tracer.start_as_current_span(f"invoke_agent {prompt}") as root:
            root.set_attribute("gen_ai.operation.name", "invoke_agent")
            root.set_attribute("gen_ai.prompt.name", prompt)
            root.set_attribute("gen_ai.prompt.version", version)
            root.set_attribute("combee.feedback.score", i / max(n, 1))
            root.set_attribute("combee.feedback.success", i % 2 == 0)
            root.set_attribute("combee.feedback.comment", f"INSIGHT-otel{i}: confirm the order id first")
            with tracer.start_as_current_span("chat sim-model") as chat:
                chat.set_attribute("gen_ai.operation.name", "chat")
                chat.set_attribute("gen_ai.request.model", "sim-model")
                chat.set_attribute(
                    "gen_ai.system_instructions",
                    json.dumps([{"type": "text", "content": "You answer support questions."}]),
                )
                chat.set_attribute(
                    "gen_ai.input.messages",
                    json.dumps([{"role": "user", "parts": [{"type": "text", "content": f"where is order {i}?"}]}]),
                )
                chat.set_attribute(
                    "gen_ai.output.messages",
                    json.dumps(
                        [{"role": "assistant", "parts": [{"type": "text", "content": f"order {i} shipped"}],
                          "finish_reason": "stop"}]
                    ),
                )
                chat.set_attribute("gen_ai.usage.input_tokens", 40 + i)
                chat.set_attribute("gen_ai.usage.output_tokens", 7)
            provider.force_flush()  # the chat span goes out alone
            with tracer.start_as_current_span("execute_tool lookup_order") as tool:
                tool.set_attribute("gen_ai.operation.name", "execute_tool")
                tool.set_attribute("gen_ai.tool.name", "lookup_order")
                tool.set_attribute("gen_ai.tool.call.arguments", json.dumps({"order": i}))
                tool.set_attribute("gen_ai.tool.call.result", "shipped")
            provider.force_flush()  # then the tool span; the root span comes later
            trace_ids.append(format(root.get_span_context().trace_id, "032x"))
    with tracer.start_as_current_span("GET /health"):
        pass

    provider.force_flush()
    provider.shutdown()
    ok = bool(exporter.results) and all(r == SpanExportResult.SUCCESS for r in exporter.results)
    print(json.dumps({"trace_ids": trace_ids, "exports": len(exporter.results), "ok": ok}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
