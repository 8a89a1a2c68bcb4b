"""The OpenTelemetry SDK set up as its documentation shows for OTLP/HTTP:
a tracer provider and a logger provider with batch processors and the
OTLP/HTTP exporters, configured only by the standard environment variables
(OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_HEADERS,
OTEL_RESOURCE_ATTRIBUTES). Shared by the agent scripts; each instrumentation
is then set up by its own documented call."""

import json

from opentelemetry import _logs, trace
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

QUESTIONS = [
    "Where is order 1001?",
    "Can I return shoes after 40 days?",
    "How do I reset my password?",
    "Do you ship to Norway?",
]


def setup(logs: bool = False):
    """Installs the global providers; returns a function that flushes and
    shuts them down (what an agent does before it exits)."""
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(tracer_provider)
    logger_provider = None
    if logs:
        logger_provider = LoggerProvider()
        logger_provider.add_log_record_processor(BatchLogRecordProcessor(OTLPLogExporter()))
        _logs.set_logger_provider(logger_provider)

    def shutdown():
        tracer_provider.force_flush()
        if logger_provider is not None:
            logger_provider.force_flush()
            logger_provider.shutdown()
        tracer_provider.shutdown()

    return shutdown


def report(**fields):
    """The script's one line of output, read by the test."""
    print(json.dumps(fields), flush=True)
