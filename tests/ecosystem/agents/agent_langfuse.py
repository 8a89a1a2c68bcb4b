"""An agent written against the `langfuse` Python SDK, pointed at combee by
its own environment variables only (LANGFUSE_BASE_URL, LANGFUSE_PUBLIC_KEY =
the combee key's prefix, LANGFUSE_SECRET_KEY = the combee key), as Langfuse's
prompt-management docs set it up.

`fetch PROMPT VERSION`: gets the prompt by label and by version, compiles it,
then answers each question with Langfuse's OpenAI integration
(`langfuse.openai`), linking the prompt to each generation; the SDK exports
those generations to combee. `fallback PROMPT`: with combee down, asks for the
prompt with a fallback and reports what the SDK served."""

import sys

from _otel import QUESTIONS, report
from langfuse import Langfuse

FALLBACK = "You are a support agent (fallback)."


def fetch(name: str, version: int) -> None:
    langfuse = Langfuse()
    by_label = langfuse.get_prompt(name, label="production", cache_ttl_seconds=0)
    by_version = langfuse.get_prompt(name, version=version, cache_ttl_seconds=0)
    latest = langfuse.get_prompt(name, label="latest", cache_ttl_seconds=0)

    from langfuse.openai import OpenAI  # Langfuse's drop-in OpenAI client

    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    for question in QUESTIONS:
        response = client.chat.completions.create(
            model="gpt-4o-mini",
            messages=[
                {"role": "system", "content": by_label.compile(topic="orders")},
                {"role": "user", "content": question},
            ],
            langfuse_prompt=by_label,
        )
        assert response.choices[0].message.content
    langfuse.flush()
    report(
        label={"version": by_label.version, "text": by_label.prompt, "compiled": by_label.compile(topic="orders"),
               "labels": by_label.labels, "is_fallback": by_label.is_fallback},
        version={"version": by_version.version, "text": by_version.prompt, "labels": by_version.labels},
        latest={"version": latest.version},
    )


def fallback(name: str) -> None:
    langfuse = Langfuse()
    prompt = langfuse.get_prompt(name, fallback=FALLBACK, max_retries=0, fetch_timeout_seconds=2)
    report(text=prompt.prompt, is_fallback=prompt.is_fallback)


if __name__ == "__main__":
    if sys.argv[1] == "fetch":
        fetch(sys.argv[2], int(sys.argv[3]))
    else:
        fallback(sys.argv[2])
