"""Each OpenTelemetry instrumentation of the `openai` client, installed from
PyPI and set up as its own documentation says, exports to combee's OTLP
endpoint with `combee.prompt` in OTEL_RESOURCE_ATTRIBUTES (as combee's docs
say); the Vercel AI SDK does the same from Node.js. Every model call must
become one combee trace with its question as input and the (simulated)
answer as output."""

from __future__ import annotations

from conftest import Combee, assert_one_trace_per_call, otlp_env, run_agent


def ingest(combee: Combee, simulator: str, prompt: str, script: str, args=(), **env: str) -> list:
    combee.create_prompt(prompt)
    key = combee.key("traces:write")
    result = run_agent(script, list(args), {**otlp_env(combee, key, simulator, prompt), **env})
    assert result["calls"] == 4
    return combee.traces(prompt)


def test_openai_v2_with_content_on_spans(combee: Combee, simulator: str) -> None:
    traces = ingest(
        combee, simulator, "eco-openai-v2-spans", "agent_openai_v2.py",
        OTEL_SEMCONV_STABILITY_OPT_IN="gen_ai_latest_experimental",
        OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT="span_only",
    )
    assert_one_trace_per_call(traces)


def test_openai_v2_with_content_as_log_events(combee: Combee, simulator: str) -> None:
    # The default conventions: gen_ai.{system,user}.message and gen_ai.choice
    # log records, joined to their span by trace and span id.
    traces = ingest(
        combee, simulator, "eco-openai-v2-events", "agent_openai_v2.py",
        OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT="true",
    )
    assert_one_trace_per_call(traces)
    assert all(len(t["trajectory"]) == 1 for t in traces), "the events belong to their span's step"
    assert all(t["metadata"]["otel"]["input_tokens"] > 0 for t in traces)


def test_openai_v2_latest_conventions_as_log_events(combee: Combee, simulator: str) -> None:
    # The latest conventions: one gen_ai.client.inference.operation.details log record per call.
    traces = ingest(
        combee, simulator, "eco-openai-v2-details", "agent_openai_v2.py",
        OTEL_SEMCONV_STABILITY_OPT_IN="gen_ai_latest_experimental",
        OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT="event_only",
    )
    assert_one_trace_per_call(traces)


def test_openinference(combee: Combee, simulator: str) -> None:
    traces = ingest(combee, simulator, "eco-openinference", "agent_openinference.py")
    assert_one_trace_per_call(traces)
    in_session = [t for t in traces if t["metadata"].get("subject")]
    assert [t["metadata"]["subject"] for t in in_session] == ["conversation-1"], "the session is the subject"
    assert "Where is order 1001?" in str(in_session[0]["input"])


def test_traceloop(combee: Combee, simulator: str) -> None:
    traces = ingest(combee, simulator, "eco-traceloop", "agent_traceloop.py")
    assert_one_trace_per_call(traces)


def test_vercel_ai_sdk(combee: Combee, simulator: str) -> None:
    # The prompt and version come from the AI SDK's runtime context, not the resource.
    combee.create_prompt("eco-vercel")
    key = combee.key("traces:write")
    for mode in ["current", "legacy"]:
        env = otlp_env(combee, key, simulator, prompt=None)
        assert run_agent("agent_vercel_ai.mjs", ["eco-vercel", "1", mode], env)["calls"] == 4
    traces = combee.traces("eco-vercel")
    assert len(traces) == 8
    for spans in (3, 2):  # OpenTelemetry: invoke_agent, step, chat; LegacyOpenTelemetry: ai.generateText(.doGenerate)
        made = [t for t in traces if t["metadata"]["otel"]["spans"] == spans]
        assert_one_trace_per_call(made)
        assert all(t["prompt_version"] == 1 for t in made)
        for t in made:  # the top span repeats its model call's usage: counted once
            per_step = [s["usage"]["input_tokens"] for s in t["trajectory"] if "usage" in s]
            assert len(per_step) == 2 and t["metadata"]["otel"]["input_tokens"] == per_step[0] == per_step[1], t
