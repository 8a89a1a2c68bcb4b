"""Getting prompts: the cache, ETag revalidation, and what an agent gets when
the server is down — against the real server."""

from __future__ import annotations

import json
from typing import Any, Dict, List

import pytest

from combee import Arm, Combee, CombeeAPIError, CombeeUnavailable, MissingVariable, Prompt
from combee._core import parse_prompt

from conftest import CombeeServer, RequestLog, free_port, wait_until

BASE = "You are a support agent for {product}. Answer in {language}."


def test_cache_hit_makes_no_request(server: CombeeServer, requests_log: RequestLog) -> None:
    server.create_prompt("support-agent", BASE)
    with Combee(server.url, server.admin_key, cache_ttl=60, http_client=requests_log.client()) as client:
        first = client.get_prompt("support-agent")
        assert (first.version, first.source, first.name) == (1, "server", "support-agent")
        assert first.text.startswith("You are a support agent")
        assert "production" in first.labels
        for _ in range(20):
            again = client.get_prompt("support-agent")
            assert again.text == first.text and again.version == 1
        assert len(requests_log.matching("GET", "/v1/prompts/")) == 1
        assert first.compile(product="Acme", language="French").startswith("You are a support agent for Acme. Answer in French.")


def test_stale_prompt_is_revalidated_with_its_etag_and_304_keeps_it(server: CombeeServer, requests_log: RequestLog) -> None:
    server.create_prompt("support-agent", BASE)
    etag = server.api("GET", "/v1/prompts/support-agent").headers["etag"]
    with Combee(server.url, server.admin_key, cache_ttl=0, http_client=requests_log.client()) as client:
        assert client.get_prompt("support-agent").version == 1
        # Stale at once (TTL 0): the cached text comes back and a revalidation starts.
        assert client.get_prompt("support-agent").version == 1

        def gets() -> List[Dict[str, Any]]:
            return requests_log.matching("GET", "/v1/prompts/")

        revalidation = wait_until(lambda: [e for e in gets()[1:] if e["status"] is not None], what="the revalidation")[0]
        assert revalidation["headers"]["if-none-match"] == etag
        assert revalidation["status"] == 304
        assert "if-none-match" not in gets()[0]["headers"]

        # A new production version: the stale text is served once more, then the new one.
        assert server.new_production_version("support-agent", "You are a terse agent.") == 2
        wait_until(lambda: client.get_prompt("support-agent").version == 2, what="version 2 through revalidation")
        assert client.get_prompt("support-agent").text.startswith("You are a terse agent.")
        assert any(e["status"] == 200 and "if-none-match" in e["headers"] for e in gets())


def test_server_down_serves_the_last_known_text(server: CombeeServer) -> None:
    server.create_prompt("support-agent", BASE)
    with Combee(server.url, server.admin_key, cache_ttl=0, timeout=1) as client:
        known = client.get_prompt("support-agent", fallback="unused fallback")
        server.stop()
        got = client.get_prompt("support-agent", fallback="unused fallback")
        assert got.text == known.text and got.version == 1
        # Once the background revalidation has failed, the answer says it is stale.
        stale = wait_until(lambda: (p := client.get_prompt("support-agent")).source == "stale" and p, what="a failed revalidation")
        assert stale.text == known.text and stale.version == 1
        # The server comes back with a new version: the client picks it up.
        server.start()
        server.new_production_version("support-agent", "Back with v2.")
        wait_until(lambda: client.get_prompt("support-agent").version == 2, what="version 2 after the restart")
        assert client.get_prompt("support-agent").source == "server"


def test_no_server_and_no_cache_gives_the_fallback_else_a_clear_error(requests_log: RequestLog) -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    with Combee(nobody, "cmb_unused", timeout=1, http_client=requests_log.client()) as client:
        p = client.get_prompt("support-agent", fallback="You are a helpful agent for {product}.")
        assert (p.text, p.version, p.source, p.arm) == ("You are a helpful agent for {product}.", None, "fallback", None)
        assert p.compile(product="Acme") == "You are a helpful agent for Acme."
        # Right after a failure the fallback comes back without waiting on the server again.
        assert client.get_prompt("support-agent", fallback="again").text == "again"
        assert len(requests_log.matching("GET", "/v1/prompts/")) == 1
        with pytest.raises(CombeeUnavailable, match="support-agent"):
            client.get_prompt("support-agent")
    with Combee(nobody, "cmb_unused", timeout=1) as client, pytest.raises(CombeeUnavailable, match="no cached text and no fallback"):
        client.get_prompt("support-agent", label="candidate")


def test_subjects_are_sent_and_cached_apart(server: CombeeServer, requests_log: RequestLog) -> None:
    server.create_prompt("support-agent", BASE)
    with Combee(server.url, server.admin_key, http_client=requests_log.client()) as client:
        for subject in ["user-1", "user-2", "user-1", "user-2"]:
            assert client.get_prompt("support-agent", subject=subject).subject == subject
        gets = requests_log.matching("GET", "/v1/prompts/")
        assert [e["headers"].get("combee-subject") for e in gets] == ["user-1", "user-2"]


def test_labels_and_refusals(server: CombeeServer) -> None:
    server.create_prompt("support-agent", BASE)
    server.new_production_version("support-agent", "Version two.")
    with Combee(server.url, server.admin_key) as client:
        assert client.get_prompt("support-agent", label="latest").version == 2
        with pytest.raises(CombeeAPIError) as err:
            client.get_prompt("no-such-prompt", fallback="not for a wrong name")
        assert err.value.status == 404
    with Combee(server.url, "cmb_wrong") as client:
        with pytest.raises(CombeeAPIError) as err:
            client.get_prompt("support-agent")
        assert err.value.status == 401
        assert "cmb_wrong" not in str(err.value)


def test_arm_is_exposed_when_the_server_sends_one() -> None:
    body = {"name": "support-agent", "version": 3, "labels": [], "text": "t", "arm": {"version": 3, "role": "challenger", "experiment": "exp-1"}}
    p = parse_prompt(json.dumps(body).encode(), None, "user-1")
    assert p.arm == Arm(version=3, role="challenger", experiment="exp-1")
    assert parse_prompt(json.dumps({**body, "arm": None}).encode(), None, None).arm is None


def test_the_servers_arm_role_is_read() -> None:
    # What `GET /v1/prompts/{name}` answers for an `evaluated` prompt's arm
    # (src/http/prompts.rs `with_arm`): the role as a string.
    body = {"name": "ab", "version": 4, "labels": ["candidate"], "text": "t", "arm": "challenger"}
    p = parse_prompt(json.dumps(body).encode(), None, "user-1")
    assert p.arm == Arm(version=4, role="challenger", experiment="ab")


def test_compile_fills_placeholders_and_leaves_other_braces_alone() -> None:
    p = Prompt("x", 'Hi {name}. Reply as JSON: {"answer": "..."} {{literal}} { spaced } {name}', 1)
    assert p.variables == ["name"]
    assert p.compile(name="Ada", unused=1) == 'Hi Ada. Reply as JSON: {"answer": "..."} {{literal}} { spaced } Ada'
    with pytest.raises(MissingVariable, match=r"\{name\}") as err:
        p.compile()
    assert isinstance(err.value, KeyError) and err.value.missing == ["name"]
