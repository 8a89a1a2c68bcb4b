"""An agent calling a model with the `openai` client, instrumented by
openinference-instrumentation-openai as its README sets it up (the
instrumentor given the tracer provider). Each model call is one trace; the
first one runs inside `using_session`, whose session id becomes the trace's
subject."""

from _otel import QUESTIONS, report, setup
from openai import OpenAI
from openinference.instrumentation import using_session
from openinference.instrumentation.openai import OpenAIInstrumentor
from opentelemetry import trace

shutdown = setup()
OpenAIInstrumentor().instrument(tracer_provider=trace.get_tracer_provider())

client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment


def ask(question: str) -> None:
    response = client.chat.completions.create(
        model="gpt-4o-mini",
        messages=[
            {"role": "system", "content": "You are a support agent."},
            {"role": "user", "content": question},
        ],
    )
    assert response.choices[0].message.content


with using_session(session_id="conversation-1"):
    ask(QUESTIONS[0])
for question in QUESTIONS[1:]:
    ask(question)
shutdown()
report(calls=len(QUESTIONS))
