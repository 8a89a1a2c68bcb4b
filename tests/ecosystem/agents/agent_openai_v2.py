"""An agent calling a model with the `openai` client, instrumented by
opentelemetry-instrumentation-openai-v2 as its README sets it up. The content
mode comes from the instrumentation's own environment variables, set by the
test: content on spans (OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental
with OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=span_only), or content
as log events (OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true, the
default conventions; or event_only with the latest ones). Each model call is
one trace."""

import os

from _otel import QUESTIONS, report, setup
from openai import OpenAI
from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor

shutdown = setup(logs=True)
OpenAIInstrumentor().instrument()

client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
for question in QUESTIONS:
    response = client.chat.completions.create(
        model=os.environ.get("AGENT_MODEL", "gpt-4o-mini"),
        messages=[
            {"role": "system", "content": "You are a support agent."},
            {"role": "user", "content": question},
        ],
    )
    assert response.choices[0].message.content
shutdown()
report(calls=len(QUESTIONS))
