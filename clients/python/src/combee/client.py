"""The synchronous client: ``Combee``. Prompts come from an in-memory cache
revalidated in the background; traces leave through a background thread."""

from __future__ import annotations

import atexit
import functools
import os
import threading
import time
import weakref
from dataclasses import replace
from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Optional, Union

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
from .errors import CombeeUnavailable
from .prompt import Prompt

_TRANSPORT_ERRORS = (httpx.TransportError,)


def serve_from_cache_or_fallback(key: CacheKey, cache: PromptCache, fallback: Optional[str], why: str, now: Optional[float] = None) -> Prompt:
    """What ``get_prompt`` answers when the server cannot: the last known text,
    else the caller's fallback, else :class:`CombeeUnavailable`. With ``now``,
    the failure is remembered so the next calls for a moment do not wait for
    the server again."""
    name, label, subject = key
    # Log the failed request itself, not every call answered in its shadow.
    warn = log.warning if now is not None else log.debug
    if now is not None:
        cache.fetch_failed(key, now)
    entry = cache.get(key)
    if entry is not None:
        warn("combee unavailable (%s): serving the last known version %s of %r", why, entry.prompt.version, name)
        return replace(entry.prompt, source="stale")
    if fallback is not None:
        warn("combee unavailable (%s): serving the fallback text for %r", why, name)
        return Prompt(name, fallback, None, label, (), None, "fallback", None, subject)
    raise CombeeUnavailable(f"cannot get prompt {name!r} ({why}); no cached text and no fallback")


def send_batch(http: httpx.Client, outbox: Outbox, batch: Batch, max_backoff: float, give_up: "threading.Event") -> None:
    """Sends one batch until it is stored, refused, or ``give_up`` is set;
    every retry of the same body carries the same Idempotency-Key."""
    queue: List[Batch] = [batch]
    while queue and not give_up.is_set():
        b = queue[0]
        try:
            res = http.post("/v1/traces", content=b.payload(), headers={"Idempotency-Key": b.key, "Content-Type": "application/json"})
            outcome = batch_outcome(res.status_code, res.content, len(b.traces))
        except _TRANSPORT_ERRORS as e:
            outcome = Retry(type(e).__name__)
        nxt = outbox.apply(b, outcome)
        if nxt is None:
            give_up.wait(backoff(b.attempts, max_backoff))
            continue
        queue[0:1] = nxt
    if queue:  # gave up: whatever was not stored is lost
        lost = sum(len(b.traces) for b in queue)
        for b in queue:
            for t in b.traces:
                t.handle._dropped()
        with outbox.cond:
            outbox.stats.lost_at_close += lost
        log.warning("combee: %d traces could not be sent before close and are lost", lost)


def send_feedback(http: httpx.Client, outbox: Outbox, items: List[PendingFeedback]) -> List[PendingFeedback]:
    """Sends feedback; returns the items to try again later."""
    again: List[PendingFeedback] = []
    for f in items:
        try:
            res = http.post(feedback_path(f), json=f.body)
            finished = feedback_outcome(f, res.status_code, res.content)
        except _TRANSPORT_ERRORS:
            f.attempts += 1
            finished = False
        if not finished:
            again.append(f)
            continue
        with outbox.cond:
            if res.status_code == 200:
                outbox.stats.feedback_sent += 1
            else:
                outbox.stats.feedback_dropped += 1
    return again


def process(http: httpx.Client, outbox: Outbox, work: Union[Batch, List[PendingFeedback]], max_backoff: float, give_up: "threading.Event") -> None:
    """Sends one piece of work taken from the outbox (the caller calls ``done``)."""
    if isinstance(work, Batch):
        send_batch(http, outbox, work, max_backoff, give_up)
        return
    again = send_feedback(http, outbox, work)
    if again:
        outbox.requeue_feedback(again)
        give_up.wait(backoff(max(f.attempts for f in again), max_backoff))


def drain(http: httpx.Client, outbox: Outbox, max_backoff: float, give_up: "threading.Event") -> None:
    """Sends everything queued, in order, until nothing is left or ``give_up``
    is set (used at interpreter exit, when no sender may be running)."""
    with outbox.cond:
        outbox.flushers += 1
    try:
        while not give_up.is_set():
            work, _ = outbox.take(time.monotonic())
            if work is None:
                return
            try:
                process(http, outbox, work, max_backoff, give_up)
            finally:
                outbox.done()
    finally:
        with outbox.cond:
            outbox.flushers -= 1


class Combee(TraceRecorder):
    """A synchronous combee client; thread-safe; one per process is enough.

    ``base_url`` defaults to ``$COMBEE_URL`` (else ``http://127.0.0.1:8080``)
    and ``api_key`` to ``$COMBEE_API_KEY`` (a key with ``prompts:read`` and
    ``traces:write``). ``cache_ttl`` (s) is how long a fetched prompt is used
    without asking the server; after it, the cached prompt is still returned at
    once while a background request revalidates it (``If-None-Match``).
    ``timeout`` (s) bounds every request. Traces are sent in batches of up to
    ``batch_size``, at least every ``flush_interval`` seconds; at most
    ``max_queue`` traces wait (newer ones are dropped beyond that); failed sends
    are retried with backoff up to ``max_backoff`` seconds between tries.
    ``close()`` (also run at interpreter exit) waits up to ``close_timeout``
    seconds for queued traces. ``http_client`` replaces the underlying
    ``httpx.Client`` (its base URL and auth headers are set by this class).
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
        http_client: Optional[httpx.Client] = None,
    ) -> None:
        self.settings = Settings.resolve(base_url, api_key, cache_ttl, timeout, batch_size, flush_interval, max_queue, max_backoff, close_timeout)
        self._own_http = http_client is None
        self._http = self._configure(http_client or httpx.Client())
        self._cache = PromptCache(self.settings.cache_ttl)
        self._closed = False
        self._start_fresh()
        atexit.register(_close_at_exit, weakref.ref(self))
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=functools.partial(_reset_in_child, weakref.ref(self)))

    def _configure(self, http: httpx.Client) -> httpx.Client:
        http.base_url = httpx.URL(self.settings.base_url)
        http.headers.update(self.settings.headers())
        http.timeout = httpx.Timeout(self.settings.timeout)
        return http

    def _start_fresh(self) -> None:
        """The per-process parts: queue, sender, revalidation threads."""
        self._revalidator = ThreadPoolExecutor(max_workers=2, thread_name_prefix="combee-revalidate")
        self._outbox = Outbox(self.settings.batch_size, self.settings.flush_interval, self.settings.max_queue)
        self._sender: Optional[threading.Thread] = None
        self._sender_lock = threading.Lock()
        self._give_up = threading.Event()

    def _after_fork_in_child(self) -> None:
        # A forked worker (gunicorn, multiprocessing) inherits the parent's
        # queue, whose traces the parent sends, but not its threads; and
        # must not share the parent's sockets.
        self._start_fresh()
        self._cache.after_fork()
        if self._own_http:
            self._http = self._configure(httpx.Client())

    # ------------------------------------------------------------ prompts

    def get_prompt(self, name: str, label: Optional[str] = None, subject: Optional[str] = None, fallback: Optional[str] = None) -> Prompt:
        """The prompt ``name`` at ``label`` (default: the server's ``production``).

        ``subject`` (a user or session id) is sent as ``Combee-Subject`` so the
        server can pick an experiment arm per subject; answers are cached per
        (name, label, subject). Within ``cache_ttl`` no request is made; after
        it the cached prompt is returned and revalidated in the background.
        When the server is unreachable or answers 5xx/429: the last known text
        (``source == "stale"``), else ``fallback`` (``source == "fallback"``,
        ``version is None``), else :class:`CombeeUnavailable`. A 4xx on a first
        fetch (unknown prompt, bad key) raises :class:`CombeeAPIError`.
        """
        key: CacheKey = (name, label, subject)
        entry, revalidate = self._cache.lookup(key, time.monotonic())
        if entry is not None:
            if revalidate:
                try:
                    self._revalidator.submit(self._revalidate, key, entry.etag)
                except RuntimeError:  # closed
                    self._cache.revalidation_failed(key, time.monotonic())
            return entry.prompt
        if self._cache.recently_unavailable(key, time.monotonic()):
            return serve_from_cache_or_fallback(key, self._cache, fallback, "it failed moments ago")
        return self._fetch(key, fallback)

    def _fetch(self, key: CacheKey, fallback: Optional[str]) -> Prompt:
        name, label, subject = key
        path, params, headers = prompt_request(name, label, subject, None)
        try:
            res = self._http.get(path, params=params, headers=headers)
        except _TRANSPORT_ERRORS as e:
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

    def _revalidate(self, key: CacheKey, etag: Optional[str]) -> None:
        name, label, subject = key
        path, params, headers = prompt_request(name, label, subject, etag)
        try:
            res = self._http.get(path, params=params, headers=headers)
            if res.status_code == 304:
                self._cache.not_modified(key, time.monotonic())
                return
            if res.status_code == 200:
                self._cache.store(key, parse_prompt(res.content, label, subject), res.headers.get("etag"), time.monotonic())
                return
            log.warning("combee: revalidating %r answered HTTP %d; keeping the cached version", name, res.status_code)
        except (httpx.HTTPError, ValueError) as e:
            log.warning("combee: revalidating %r failed (%s); keeping the cached version", name, type(e).__name__)
        except Exception:  # a background thread must not die silently
            log.exception("combee: revalidating %r failed", name)
        self._cache.revalidation_failed(key, time.monotonic())

    # ------------------------------------------------------------ traces

    def _ensure_sender(self) -> None:
        if self._sender is not None or self._closed:
            return
        with self._sender_lock:
            if self._sender is None and not self._closed:
                self._sender = threading.Thread(target=self._run_sender, name="combee-traces", daemon=True)
                self._sender.start()

    def _run_sender(self) -> None:
        outbox = self._outbox
        while not self._give_up.is_set():
            with outbox.cond:
                work, wait = outbox.take(time.monotonic())
                if work is None:
                    if outbox.closing:
                        return
                    outbox.cond.wait(wait)
                    continue
            try:
                process(self._http, outbox, work, self.settings.max_backoff, self._give_up)
            except Exception:  # keep the thread alive whatever happens
                log.exception("combee trace sender failed; continuing")
            finally:
                outbox.done()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Sends everything queued now, and waits (up to ``timeout`` s) until
        it is stored or refused. Returns ``False`` when time ran out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        outbox = self._outbox
        with outbox.cond:
            outbox.flushers += 1
            outbox.cond.notify_all()
        if outbox.pending():
            self._ensure_sender()
        try:
            with outbox.cond:
                while outbox.traces or outbox.feedback or outbox.in_flight:
                    if self._sender is None or not self._sender.is_alive():
                        return False
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    outbox.cond.wait(left if left is not None else 0.5)
                return True
        finally:
            with outbox.cond:
                outbox.flushers -= 1

    @property
    def stats(self) -> TraceStats:
        """Counters: traces queued, sent, dropped (queue full), rejected, lost at close, retries."""
        return self._outbox.stats

    def close(self, timeout: Optional[float] = None) -> None:
        """Flushes (up to ``timeout``, default ``close_timeout`` s), then stops
        the sender and closes the connections. Idempotent."""
        if self._closed:
            return
        self.flush(self.settings.close_timeout if timeout is None else timeout)
        self._closed = True
        with self._outbox.cond:
            self._outbox.closing = True
            self._outbox.cond.notify_all()
        self._give_up.set()
        if self._sender is not None:
            self._sender.join(timeout=self.settings.timeout + 1)
        lost = self._outbox.abandon()
        if lost:
            log.warning("combee closed before everything was sent: %d queued traces lost", lost)
        self._revalidator.shutdown(wait=False)
        self._http.close()

    def __enter__(self) -> "Combee":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _reset_in_child(ref: "weakref.ReferenceType[Combee]") -> None:
    client = ref()
    if client is not None and not client._closed:
        client._after_fork_in_child()


def _close_at_exit(ref: "weakref.ReferenceType[Combee]") -> None:
    client = ref()
    if client is not None:
        client.close()

