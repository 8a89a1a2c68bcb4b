"""The asyncio client: ``AsyncCombee``. Same behaviour as ``Combee``, with
revalidation and trace sending as tasks on the caller's event loop."""

from __future__ import annotations

import asyncio
import atexit
import threading
import time
import weakref
from typing import Any, List, Optional, Set

import httpx

from ._core import (
    Batch,
    CacheKey,
    Outbox,
    PendingFeedback,
    PromptCache,
    Retry,
    Settings,
    TraceStats,
    api_error,
    backoff,
    batch_outcome,
    feedback_outcome,
    feedback_path,
    is_unavailable,
    log,
    parse_prompt,
    prompt_request,
)
from ._tracing import TraceRecorder
from .client import drain, serve_from_cache_or_fallback
from .prompt import Prompt


class AsyncCombee(TraceRecorder):
    """An asyncio combee client. Arguments as for :class:`combee.Combee`
    (``http_client`` is an ``httpx.AsyncClient``).

    ``log_trace``, ``trace``, ``traced`` and ``feedback`` are plain (non-async)
    calls that only queue; a task on the running loop sends the batches. Use
    ``async with AsyncCombee(...)`` or ``await client.aclose()`` to flush on
    shutdown; traces still queued at interpreter exit are sent by a blocking
    fallback (bounded by ``close_timeout``).
    """

    def __init__(
        self,
        base_url: Optional[str] = None,
        api_key: Optional[str] = None,
        *,
        cache_ttl: float = 60.0,
        timeout: float = 5.0,
        batch_size: int = 100,
        flush_interval: float = 1.0,
        max_queue: int = 10_000,
        max_backoff: float = 30.0,
        close_timeout: float = 5.0,
        http_client: Optional[httpx.AsyncClient] = None,
    ) -> None:
        self.settings = Settings.resolve(base_url, api_key, cache_ttl, timeout, batch_size, flush_interval, max_queue, max_backoff, close_timeout)
        self._http = http_client or httpx.AsyncClient()
        self._http.base_url = httpx.URL(self.settings.base_url)
        self._http.headers.update(self.settings.headers())
        self._http.timeout = httpx.Timeout(self.settings.timeout)
        self._cache = PromptCache(self.settings.cache_ttl)
        self._outbox = Outbox(self.settings.batch_size, self.settings.flush_interval, self.settings.max_queue)
        self._tasks: Set["asyncio.Task[None]"] = set()
        self._sender: Optional["asyncio.Task[None]"] = None
        self._wakeup: Optional[asyncio.Event] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._closed = False
        self._outbox.wake = self._wake
        atexit.register(_drain_at_exit, weakref.ref(self))

    # ------------------------------------------------------------ prompts

    async def get_prompt(self, name: str, label: Optional[str] = None, subject: Optional[str] = None, fallback: Optional[str] = None) -> Prompt:
        """As :meth:`combee.Combee.get_prompt`; a stale entry is returned at
        once and revalidated by a background task."""
        key: CacheKey = (name, label, subject)
        entry, revalidate = self._cache.lookup(key, time.monotonic())
        if entry is not None:
            if revalidate:
                self._spawn(self._revalidate(key, entry.etag))
            return entry.prompt
        if self._cache.recently_unavailable(key, time.monotonic()):
            return serve_from_cache_or_fallback(key, self._cache, fallback, "it failed moments ago")
        return await self._fetch(key, fallback)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fetch(self, key: CacheKey, fallback: Optional[str]) -> Prompt:
        name, label, subject = key
        path, params, headers = prompt_request(name, label, subject, None)
        try:
            res = await self._http.get(path, params=params, headers=headers)
        except httpx.TransportError as e:
            return serve_from_cache_or_fallback(key, self._cache, fallback, type(e).__name__, time.monotonic())
        if res.status_code == 200:
            try:
                prompt = parse_prompt(res.content, label, subject)
            except ValueError as e:
                return serve_from_cache_or_fallback(key, self._cache, fallback, f"unreadable answer: {e}", time.monotonic())
            self._cache.store(key, prompt, res.headers.get("etag"), time.monotonic())
            return prompt
        if is_unavailable(res.status_code):
            return serve_from_cache_or_fallback(key, self._cache, fallback, f"HTTP {res.status_code}", time.monotonic())
        raise api_error(res.status_code, res.content)

    async def _revalidate(self, key: CacheKey, etag: Optional[str]) -> None:
        name, label, subject = key
        path, params, headers = prompt_request(name, label, subject, etag)
        try:
            res = await self._http.get(path, params=params, headers=headers)
            if res.status_code == 304:
                self._cache.not_modified(key, time.monotonic())
                return
            if res.status_code == 200:
                self._cache.store(key, parse_prompt(res.content, label, subject), res.headers.get("etag"), time.monotonic())
                return
            log.warning("combee: revalidating %r answered HTTP %d; keeping the cached version", name, res.status_code)
        except (httpx.HTTPError, ValueError) as e:
            log.warning("combee: revalidating %r failed (%s); keeping the cached version", name, type(e).__name__)
        except Exception:
            log.exception("combee: revalidating %r failed", name)
        self._cache.revalidation_failed(key, time.monotonic())

    # ------------------------------------------------------------ traces

    def _wake(self) -> None:
        loop, ev = self._loop, self._wakeup
        if loop is None or ev is None or loop.is_closed():
            return
        try:
            running: Optional[asyncio.AbstractEventLoop] = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        try:
            if running is loop:
                ev.set()
            else:
                loop.call_soon_threadsafe(ev.set)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _ensure_sender(self) -> None:
        if self._closed or (self._sender is not None and not self._sender.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not on a loop: the next async call (or exit) sends
        self._loop = loop
        self._wakeup = asyncio.Event()
        self._sender = loop.create_task(self._run_sender())

    async def _run_sender(self) -> None:
        outbox = self._outbox
        assert self._wakeup is not None
        while True:
            work, wait = outbox.take(time.monotonic())
            if work is None:
                if outbox.closing:
                    return
                self._wakeup.clear()
                # re-check after clearing so a wake between take() and clear() is not lost
                work, wait = outbox.take(time.monotonic())
                if work is None:
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), wait)
                    except asyncio.TimeoutError:
                        pass
                    continue
            try:
                if isinstance(work, Batch):
                    await self._send_batch(work)
                else:
                    await self._send_feedback(work)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("combee trace sender failed; continuing")
            finally:
                outbox.done()

    async def _send_batch(self, batch: Batch) -> None:
        queue: List[Batch] = [batch]
        try:
            await self._send_batches(queue)
        except asyncio.CancelledError:  # closed while retrying: what is left is lost
            lost = [t for b in queue for t in b.traces]
            for t in lost:
                t.handle._dropped()
            with self._outbox.cond:
                self._outbox.stats.lost_at_close += len(lost)
            if lost:
                log.warning("combee: %d traces could not be sent before close and are lost", len(lost))
            raise

    async def _send_batches(self, queue: List[Batch]) -> None:
        while queue:
            b = queue[0]
            try:
                res = await self._http.post("/v1/traces", content=b.payload(), headers={"Idempotency-Key": b.key, "Content-Type": "application/json"})
                outcome: Any = batch_outcome(res.status_code, res.content, len(b.traces))
            except httpx.TransportError as e:
                outcome = Retry(type(e).__name__)
            nxt = self._outbox.apply(b, outcome)
            if nxt is None:
                await asyncio.sleep(backoff(b.attempts, self.settings.max_backoff))
                continue
            queue[0:1] = nxt

    async def _send_feedback(self, items: List[PendingFeedback]) -> None:
        again: List[PendingFeedback] = []
        for f in items:
            try:
                res = await self._http.post(feedback_path(f), json=f.body)
                finished = feedback_outcome(f, res.status_code, res.content)
            except httpx.TransportError:
                f.attempts += 1
                finished = False
            if not finished:
                again.append(f)
                continue
            with self._outbox.cond:
                if res.status_code == 200:
                    self._outbox.stats.feedback_sent += 1
                else:
                    self._outbox.stats.feedback_dropped += 1
        if again:
            self._outbox.requeue_feedback(again)
            await asyncio.sleep(backoff(max(f.attempts for f in again), self.settings.max_backoff))

    async def flush(self, timeout: Optional[float] = None) -> bool:
        """Sends everything queued now and waits (up to ``timeout`` s) until it
        is stored or refused. Returns ``False`` when time ran out."""
        outbox = self._outbox
        with outbox.cond:
            outbox.flushers += 1
        try:
            self._ensure_sender()
            self._wake()
            deadline = None if timeout is None else time.monotonic() + timeout
            while not outbox.idle():
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                await asyncio.sleep(0.01)
            return True
        finally:
            with outbox.cond:
                outbox.flushers -= 1

    @property
    def stats(self) -> TraceStats:
        """Counters, as :attr:`combee.Combee.stats`."""
        return self._outbox.stats

    async def aclose(self, timeout: Optional[float] = None) -> None:
        """Flushes (up to ``timeout``, default ``close_timeout`` s), stops the
        sender and the revalidations, and closes the connections. Idempotent."""
        if self._closed:
            return
        await self.flush(self.settings.close_timeout if timeout is None else timeout)
        self._closed = True
        with self._outbox.cond:
            self._outbox.closing = True
        for task in [self._sender, *self._tasks]:
            if task is not None and not task.done():
                task.cancel()
        await asyncio.gather(*(t for t in [self._sender, *self._tasks] if t is not None), return_exceptions=True)
        lost = self._outbox.abandon()
        if lost:
            log.warning("combee closed before everything was sent: %d queued traces lost", lost)
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncCombee":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


def _drain_at_exit(ref: "weakref.ReferenceType[AsyncCombee]") -> None:
    """The event loop is usually gone at exit: send what is left with a
    blocking client, same batches and idempotency rules, bounded in time."""
    client = ref()
    if client is None or client._closed or client._outbox.idle():
        return
    give_up = threading.Event()
    timer = threading.Timer(client.settings.close_timeout, give_up.set)
    timer.start()
    try:
        with httpx.Client(base_url=client.settings.base_url, headers=client.settings.headers(), timeout=client.settings.timeout) as http:
            drain(http, client._outbox, client.settings.max_backoff, give_up)
    finally:
        timer.cancel()
    lost = client._outbox.abandon()
    if lost:
        log.warning("combee: %d traces could not be sent before exit and are lost", lost)

