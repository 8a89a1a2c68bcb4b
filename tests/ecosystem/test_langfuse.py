"""Code written against the Langfuse SDKs — the `langfuse` Python SDK and the
JS `@langfuse/client` (with `@langfuse/otel` and `@langfuse/tracing`) —
pointed at combee by the SDKs' own environment variables: each fetches a
combee prompt by label and by version (`{topic}` comes as `{{topic}}`, which
the SDK's `compile` fills), serves its own fallback when combee is down, and
the generations it traces, linked to the prompt, land in combee as traces of
that prompt's version."""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import pytest
from conftest import Combee, assert_one_trace_per_call, run_agent

SCRIPTS = {"python": "agent_langfuse.py", "js": "agent_langfuse_client.mjs"}
FALLBACK = "You are a support agent (fallback)."


def langfuse_env(server: Combee, key: str, simulator: str) -> Dict[str, str]:
    """What a Langfuse user changes: the base URL and the key pair."""
    return {
        "LANGFUSE_BASE_URL": server.url,
        "LANGFUSE_PUBLIC_KEY": key[:12],
        "LANGFUSE_SECRET_KEY": key,
        "OPENAI_BASE_URL": simulator,
        "OPENAI_API_KEY": "simulation",
    }


@pytest.mark.parametrize("sdk", ["python", "js"])
def test_prompts_by_label_and_version_and_traces(combee: Combee, simulator: str, sdk: str) -> None:
    prompt = f"eco-langfuse-{sdk}"
    combee.create_prompt(prompt, "You are a support agent for {topic}.")
    second = combee.add_version(prompt, "You are a support agent for {topic}. Be brief.")
    key = combee.key("prompts:read", "traces:write")
    got = run_agent(SCRIPTS[sdk], ["fetch", prompt, str(second)], langfuse_env(combee, key, simulator))

    # A version added without labels leaves production on version 1.
    assert got["label"] == {
        "version": 1,
        "text": "You are a support agent for {{topic}}.",
        "compiled": "You are a support agent for orders.",
        "labels": ["production"],
        "is_fallback": False,
    }
    assert got["version"] == {"version": second, "text": "You are a support agent for {{topic}}. Be brief.", "labels": []}
    traces = combee.traces(prompt)
    assert_one_trace_per_call(traces)
    assert all(t["prompt_version"] == 1 for t in traces), "the linked prompt names the version"


@pytest.mark.parametrize("sdk", ["python", "js"])
def test_the_fallback_is_served_when_combee_is_down(tmp_path: Path, simulator: str, sdk: str) -> None:
    server = Combee(tmp_path / "down")
    server.create_prompt("eco-langfuse-down")
    key = server.key("prompts:read")
    env = langfuse_env(server, key, simulator)
    server.process.stop()
    got = run_agent(SCRIPTS[sdk], ["fallback", "eco-langfuse-down"], env)
    assert got == {"text": FALLBACK, "is_fallback": True}
