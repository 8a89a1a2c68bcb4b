"""The asyncio client against the real server: the same cache, fallback and
trace guarantees as the sync one, with tasks instead of threads."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any, Awaitable, Callable, List

import pytest

from combee import AsyncCombee, CombeeUnavailable

from conftest import CombeeServer, RequestLog, free_port


async def eventually(check: Callable[[], Awaitable[Any]], timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


def test_async_cache_hit_and_304_revalidation(server: CombeeServer, requests_log: RequestLog) -> None:
    server.create_prompt("support-agent", "You are a support agent for {product}.")

    async def main() -> None:
        async with AsyncCombee(server.url, server.admin_key, cache_ttl=60, http_client=requests_log.async_client()) as client:
            first = await client.get_prompt("support-agent")
            for _ in range(10):
                assert (await client.get_prompt("support-agent")).version == 1
            assert len(requests_log.matching("GET", "/v1/prompts/")) == 1
            assert first.compile(product="Acme") == "You are a support agent for Acme."
        async with AsyncCombee(server.url, server.admin_key, cache_ttl=0, http_client=requests_log.async_client()) as client:
            await client.get_prompt("support-agent")
            await client.get_prompt("support-agent")  # stale: served, revalidated by a task

            async def revalidated() -> bool:
                return any(e["status"] == 304 and "if-none-match" in e["headers"] for e in requests_log.entries)

            await eventually(revalidated, what="a 304 revalidation")
            server.new_production_version("support-agent", "Version two.")

            async def v2() -> bool:
                return (await client.get_prompt("support-agent")).version == 2

            await eventually(v2, what="version 2")

    asyncio.run(main())


def test_async_fallback_and_unavailable() -> None:
    async def main() -> None:
        async with AsyncCombee(f"http://127.0.0.1:{free_port()}", "cmb_unused", timeout=1) as client:
            p = await client.get_prompt("support-agent", fallback="Be helpful.")
            assert (p.text, p.version, p.source) == ("Be helpful.", None, "fallback")
            with pytest.raises(CombeeUnavailable):
                await client.get_prompt("support-agent")

    asyncio.run(main())


def test_async_traces_survive_a_restart_and_take_late_feedback(server: CombeeServer) -> None:
    server.create_prompt("support-agent", "You are a support agent.")

    async def main() -> List[str]:
        logged: List[str] = []
        async with AsyncCombee(server.url, server.admin_key, batch_size=4, flush_interval=0.05, max_backoff=0.3, timeout=2) as client:
            prompt = await client.get_prompt("support-agent")
            first = client.log_trace(prompt, {"n": 0}, "out")
            client.feedback(first, score=0.5)
            logged.append(first.external_id)
            for i in range(1, 10):
                logged.append(client.log_trace(prompt, {"n": i}).external_id)
            assert await client.flush(timeout=10)
            assert first.id is not None
            server.stop()
            for i in range(10, 20):
                logged.append(client.log_trace(prompt, {"n": i}).external_id)

            async def retried() -> bool:
                return client.stats.retries >= 2

            await eventually(retried, what="retries while the server is down")
            await asyncio.get_running_loop().run_in_executor(None, server.start)
            for i in range(20, 30):
                logged.append(client.log_trace(prompt, {"n": i}).external_id)
            assert await client.flush(timeout=30)
            assert client.stats.sent == 30 and client.stats.feedback_sent == 1
            fb = server.api("GET", f"/v1/traces/{first.id}").json()["feedback"]
            assert fb == {"score": 0.5}
        return logged

    logged = asyncio.run(main())
    stored = Counter(t["external_id"] for t in server.traces("support-agent"))
    assert set(stored) == set(logged) and sum(stored.values()) == 30 and max(stored.values()) == 1
