"""An agent calling a model with the `openai` client, instrumented by
traceloop's opentelemetry-instrumentation-openai as its README sets it up
(content is traced by default). Each model call is one trace."""

from _otel import QUESTIONS, report, setup
from openai import OpenAI
from opentelemetry.instrumentation.openai import OpenAIInstrumentor

shutdown = setup()
OpenAIInstrumentor().instrument()

client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
for question in QUESTIONS:
    response = client.chat.completions.create(
        model="gpt-4o-mini",
        messages=[
            {"role": "system", "content": "You are a support agent."},
            {"role": "user", "content": question},
        ],
    )
    assert response.choices[0].message.content
shutdown()
report(calls=len(QUESTIONS))
