"""Logging traces: batching, retries with the same idempotency key across a
server restart and a lost answer, late feedback, the context manager and
decorator, the drop policy, and the flush at exit — against the real server."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections import Counter
from typing import List

import httpx
import pytest

from combee import Combee, CombeeAPIError

from conftest import CombeeServer, RequestLog, free_port, wait_until


def stored_external_ids(server: CombeeServer, prompt: str) -> "Counter[str]":
    return Counter(t["external_id"] for t in server.traces(prompt))


def test_traces_are_batched_and_stored_with_the_prompt_version(server: CombeeServer, requests_log: RequestLog) -> None:
    server.create_prompt("support-agent", "You are a support agent.")
    with Combee(server.url, server.admin_key, batch_size=10, flush_interval=60, http_client=requests_log.client()) as client:
        prompt = client.get_prompt("support-agent")
        handles = [
            client.log_trace(prompt, {"question": f"q{i}"}, f"a{i}", trajectory=[{"role": "assistant", "content": f"a{i}"}], feedback={"success": i % 2 == 0})
            for i in range(25)
        ]
        assert client.flush(timeout=10)
        posts = requests_log.matching("POST", "/v1/traces")
        assert [p["status"] for p in posts] == [201, 201, 201]  # 10 + 10 + 5
        assert len({p["headers"]["idempotency-key"] for p in posts}) == 3
    stored = {t["id"]: t for t in server.traces("support-agent")}
    assert len(stored) == 25
    for i, h in enumerate(handles):
        assert h.status == "stored"
        t = stored[h.id]
        assert t["external_id"] == h.external_id
        assert (t["prompt_version"], t["input"], t["output"]) == (1, {"question": f"q{i}"}, f"a{i}")
        assert t["feedback"]["success"] == (i % 2 == 0)


def test_a_server_restart_in_the_middle_loses_nothing_and_stores_nothing_twice(server: CombeeServer, requests_log: RequestLog) -> None:
    server.create_prompt("support-agent", "You are a support agent.")
    client = Combee(server.url, server.admin_key, batch_size=7, flush_interval=0.05, max_backoff=0.3, timeout=2, http_client=requests_log.client())
    logged: List[str] = []

    def log_some(n: int) -> None:
        for _ in range(n):
            started = time.monotonic()
            logged.append(client.log_trace("support-agent", {"n": len(logged)}, "ok", prompt_version=1).external_id)
            assert time.monotonic() - started < 0.05, "log_trace must not block the agent"

    log_some(30)
    wait_until(lambda: client.stats.sent >= 14, what="some traces to be sent before the stop")
    server.stop()
    log_some(30)
    wait_until(lambda: client.stats.retries >= 2, what="the sender to retry against the stopped server")
    assert client.flush(timeout=0.2) is False  # nothing can be stored while the server is down
    server.start()
    log_some(30)
    assert client.flush(timeout=30)
    client.close()

    stored = stored_external_ids(server, "support-agent")
    assert sum(stored.values()) == 90
    assert set(stored) == set(logged), "every logged trace is stored"
    assert max(stored.values()) == 1, "no trace is stored twice"
    assert client.stats.sent == 90 and client.stats.dropped_queue_full == 0 and client.stats.rejected == 0
    posts = requests_log.matching("POST", "/v1/traces")
    assert any(p["status"] is None for p in posts), "some sends failed while the server was down"


class LoseAnswers(httpx.HTTPTransport):
    """Delivers the first ``n`` trace batches to the server, then drops the
    answer as a broken connection would: the server stored them, the client
    does not know."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.left = n

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.url.path == "/v1/traces" and self.left > 0:
            self.left -= 1
            response.read()
            response.close()
            raise httpx.ReadError("connection reset after the server answered", request=request)
        return response


def test_a_lost_answer_is_retried_with_the_same_key_and_replayed(server: CombeeServer, requests_log: RequestLog) -> None:
    server.create_prompt("support-agent", "You are a support agent.")
    http = requests_log.client(transport=LoseAnswers(2))
    with Combee(server.url, server.admin_key, batch_size=5, flush_interval=60, max_backoff=0.2, http_client=http) as client:
        handles = [client.log_trace("support-agent", {"n": i}) for i in range(5)]
        assert client.flush(timeout=10)
    posts = requests_log.matching("POST", "/v1/traces")
    assert len(posts) == 3 and len({p["headers"]["idempotency-key"] for p in posts}) == 1
    assert posts[-1]["status"] == 201 and posts[-1]["replayed"]
    stored = stored_external_ids(server, "support-agent")
    assert sorted(stored) == sorted(h.external_id for h in handles) and max(stored.values()) == 1
    assert {h.id for h in handles} == {t["id"] for t in server.traces("support-agent")}


def test_late_feedback_by_handle_before_the_trace_is_stored(server: CombeeServer) -> None:
    server.create_prompt("support-agent", "You are a support agent.")
    with Combee(server.url, server.admin_key, flush_interval=60) as client:
        h = client.log_trace("support-agent", {"q": "reset password"}, "Settings > Security", feedback={"success": True})
        assert h.id is None
        client.feedback(h, score=0.25, comment="too terse")
        assert client.flush(timeout=10)
        assert h.id is not None and client.stats.feedback_sent == 1
        client.feedback(h.id, ground_truth={"answer": "Settings > Security > Reset"})
        assert client.flush(timeout=10)
    fb = server.api("GET", f"/v1/traces/{h.id}").json()["feedback"]
    assert fb == {"success": True, "score": 0.25, "comment": "too terse", "ground_truth": {"answer": "Settings > Security > Reset"}}
    with Combee(server.url, server.admin_key) as client, pytest.raises(ValueError, match="UUID"):
        client.feedback("not-an-id", score=1)


def test_context_manager_and_decorator_record_runs_and_errors(server: CombeeServer) -> None:
    server.create_prompt("support-agent", "You are a support agent.")
    with Combee(server.url, server.admin_key, flush_interval=60) as client:
        prompt = client.get_prompt("support-agent")
        with client.trace(prompt, input={"q": "hi"}) as ok:
            ok.step({"role": "tool", "name": "search", "content": "docs"})
            ok.output = "hello"
            ok.feedback(score=0.9)
        with pytest.raises(ZeroDivisionError):
            with client.trace(prompt, input={"q": "divide"}) as failed:
                failed.step("thinking")
                1 / 0

        @client.traced("support-agent")
        def answer(question: str, polite: bool = True) -> str:
            return f"answer to {question}" + (" please" if polite else "")

        assert answer("why?") == "answer to why? please"
        assert client.flush(timeout=10)
        assert ok.handle is not None and failed.handle is not None
    t = server.api("GET", f"/v1/traces/{ok.handle.id}").json()
    assert (t["output"], t["prompt_version"], t["feedback"]["score"]) == ("hello", 1, 0.9)
    assert t["trajectory"] == [{"role": "tool", "name": "search", "content": "docs"}]
    t = server.api("GET", f"/v1/traces/{failed.handle.id}").json()
    assert t["feedback"]["success"] is False and "ZeroDivisionError" in t["feedback"]["error"]
    decorated = [x for x in server.traces("support-agent") if x["input"] == {"question": "why?", "polite": True}]
    assert len(decorated) == 1 and decorated[0]["output"] == "answer to why? please" and decorated[0]["prompt_version"] == 1


def test_a_rejected_trace_does_not_take_its_batch_down(server: CombeeServer) -> None:
    server.create_prompt("support-agent", "You are a support agent.")
    with Combee(server.url, server.admin_key, batch_size=3, flush_interval=60) as client:
        good1 = client.log_trace("support-agent", {"n": 1})
        bad = client.log_trace("no-such-prompt", {"n": 2})
        good2 = client.log_trace("support-agent", {"n": 3})
        assert client.flush(timeout=10)
        assert (good1.status, bad.status, good2.status) == ("stored", "dropped", "stored")
        assert client.stats.rejected == 1 and client.stats.sent == 2
    assert sorted(stored_external_ids(server, "support-agent")) == sorted([good1.external_id, good2.external_id])


def test_a_full_queue_drops_new_traces_and_never_blocks() -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    client = Combee(nobody, "cmb_unused", batch_size=1, max_queue=3, flush_interval=60, max_backoff=0.05, timeout=0.5)
    started = time.monotonic()
    handles = [client.log_trace("support-agent", {"n": i}) for i in range(10)]
    assert time.monotonic() - started < 0.5
    # One batch may already be in the sender's hands; the queue holds at most 3 more.
    assert client.stats.dropped_queue_full >= 6
    assert [h.status for h in handles[-3:]] == ["dropped"] * 3
    assert client.flush(timeout=0.2) is False
    client.close(timeout=0.1)
    assert all(h.status == "dropped" for h in handles)
    assert client.stats.sent == 0
    assert client.stats.dropped_queue_full + client.stats.lost_at_close == 10


def test_traces_are_flushed_at_interpreter_exit(server: CombeeServer) -> None:
    server.create_prompt("support-agent", "You are a support agent.")
    script = textwrap.dedent(
        """
        import sys
        from combee import Combee, AsyncCombee
        import asyncio
        client = Combee(sys.argv[1], sys.argv[2], flush_interval=3600)
        for i in range(5):
            client.log_trace("support-agent", {"sync": i}, external_id=f"sync-{i}")
        aclient = AsyncCombee(sys.argv[1], sys.argv[2], flush_interval=3600)
        async def main():
            for i in range(5):
                aclient.log_trace("support-agent", {"async": i}, external_id=f"async-{i}")
        asyncio.run(main())
        # no flush, no close: the atexit hooks must send them
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script, server.url, server.admin_key], env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    stored = stored_external_ids(server, "support-agent")
    assert stored == Counter([f"sync-{i}" for i in range(5)] + [f"async-{i}" for i in range(5)])


def test_bad_calls_fail_at_the_call_site(server: CombeeServer) -> None:
    with Combee(server.url, server.admin_key) as client:
        with pytest.raises(ValueError, match="input"):
            client.log_trace("support-agent", None)
        with pytest.raises(ValueError, match="unknown feedback"):
            client.log_trace("support-agent", {}, feedback={"stars": 5})
        with pytest.raises(ValueError, match="finite"):
            client.feedback("0190b5a0-0000-7000-8000-000000000000", score=float("nan"))
    with pytest.raises(ValueError, match="http"):
        Combee("localhost:8080")




def test_values_json_cannot_carry_do_not_sink_a_batch(server: CombeeServer) -> None:
    server.create_prompt("support-agent", "You are a support agent.")
    client = Combee(server.url, server.admin_key, flush_interval=60)
    odd = client.log_trace("support-agent", {"x": float("nan"), "when": time}, [float("inf"), 1.5])
    plain = client.log_trace("support-agent", {"x": 1})
    assert client.flush(timeout=10)
    assert (odd.status, plain.status) == ("stored", "stored")
    t = server.api("GET", f"/v1/traces/{odd.id}").json()
    assert t["input"]["x"] == "nan" and t["input"]["when"].startswith("<module 'time'")
    assert t["output"] == ["inf", 1.5]
    client.close()
    late = client.log_trace("support-agent", {"x": 2})
    assert late.status == "dropped"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_worker_sends_its_own_traces_and_not_its_parents(server: CombeeServer) -> None:
    server.create_prompt("support-agent", "You are a support agent.")
    client = Combee(server.url, server.admin_key, flush_interval=60)
    assert client.get_prompt("support-agent").version == 1
    client.log_trace("support-agent", {"who": "parent"}, external_id="parent-1")  # queued at fork time
    pid = os.fork()
    if pid == 0:  # the child: like a gunicorn worker forked after the client was made
        code = 1
        try:
            assert client.get_prompt("support-agent").version == 1
            h = client.log_trace("support-agent", {"who": "child"}, external_id="child-1")
            code = 0 if client.flush(timeout=10) and h.status == "stored" else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert client.flush(timeout=10)
    client.close()
    assert stored_external_ids(server, "support-agent") == Counter({"parent-1": 1, "child-1": 1})


def test_two_projects_prompts_of_one_name_each_get_their_own_traces(server: CombeeServer) -> None:
    """Names are per project: a project's key names its prompt bare, a
    server-wide key writes ``team-a/support-agent``; the served ``name`` is
    the one any key writes back, so traces logged with the Prompt land in
    the project the prompt came from."""
    for project in ("team-a", "team-b"):
        assert server.api("POST", "/v1/projects", json={"name": project}).status_code == 201
        body = {"name": "support-agent", "base": f"You help {project}.", "project": project}
        assert server.api("POST", "/v1/prompts", json=body).status_code == 201
    res = server.api("POST", "/v1/keys", json={"name": "a", "scopes": ["prompts:read", "traces:write"], "project": "team-a"})
    key_a = res.json()["secret"]
    with Combee(server.url, key_a, flush_interval=60) as client:
        mine = client.get_prompt("support-agent")
        assert (mine.name, mine.text) == ("team-a/support-agent", "You help team-a.")
        client.log_trace(mine, {"q": "from a"}, "ok")
        assert client.flush(timeout=10)
    with Combee(server.url, server.admin_key, flush_interval=60) as client:
        theirs = client.get_prompt("team-b/support-agent")
        assert (theirs.name, theirs.text) == ("team-b/support-agent", "You help team-b.")
        client.log_trace(theirs, {"q": "from the server-wide key"}, "ok")
        assert client.flush(timeout=10)
        with pytest.raises(CombeeAPIError) as absent:
            client.get_prompt("support-agent")  # `default` holds none; the answer says who does
        assert "team-a" in str(absent.value) and "team-b" in str(absent.value)
    assert [t["input"] for t in server.traces("team-a/support-agent")] == [{"q": "from a"}]
    assert [t["input"] for t in server.traces("team-b/support-agent")] == [{"q": "from the server-wide key"}]
