"""The I/O-free heart shared by the sync and async clients: settings, the
prompt cache, how server answers are read, and the trace outbox with its
batching, retry and drop rules. The clients only add the transport."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Tuple, Union
from urllib.parse import quote

from .errors import CombeeAPIError
from .prompt import Arm, Prompt

log = logging.getLogger("combee")

DEFAULT_URL = "http://127.0.0.1:8080"
SUBJECT_HEADER = "Combee-Subject"
USER_AGENT = "combee-python/0.1.0"

CacheKey = Tuple[str, Optional[str], Optional[str]]

# After a failed request for a prompt, how long calls are answered from the
# cache or the fallback without asking the server again (so an agent whose
# server is down does not pay a timeout on every call).
UNAVAILABLE_RETRY_SECS = 1.0


@dataclass(frozen=True)
class Settings:
    """Everything a client is configured with (see ``Combee.__init__``)."""

    base_url: str
    api_key: Optional[str] = field(repr=False)
    cache_ttl: float
    timeout: float
    batch_size: int
    flush_interval: float
    max_queue: int
    max_backoff: float
    close_timeout: float

    @staticmethod
    def resolve(
        base_url: Optional[str],
        api_key: Optional[str],
        cache_ttl: float,
        timeout: float,
        batch_size: int,
        flush_interval: float,
        max_queue: int,
        max_backoff: float,
        close_timeout: float,
    ) -> "Settings":
        url = (base_url or os.environ.get("COMBEE_URL") or DEFAULT_URL).rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, not {url!r}")
        if api_key is None:
            api_key = os.environ.get("COMBEE_API_KEY")
        if cache_ttl < 0 or timeout <= 0 or flush_interval < 0 or max_backoff <= 0 or close_timeout < 0:
            raise ValueError("cache_ttl, flush_interval and close_timeout must be >= 0; timeout and max_backoff > 0")
        if not 1 <= batch_size <= 500:
            raise ValueError("batch_size must be between 1 and 500 (the server's default batch limit)")
        if max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        return Settings(url, api_key, cache_ttl, timeout, batch_size, flush_interval, max_queue, max_backoff, close_timeout)

    def headers(self) -> Dict[str, str]:
        h = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


# ---------------------------------------------------------------- prompts


@dataclass
class CacheEntry:
    prompt: Prompt
    etag: Optional[str]
    fresh_until: float
    revalidating: bool = False


class PromptCache:
    """In-memory prompts keyed by (name, label, subject). Fresh within the TTL;
    a stale entry is still served while one background revalidation runs."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._lock = threading.Lock()
        self._entries: Dict[CacheKey, CacheEntry] = {}
        self._unavailable_until: Dict[CacheKey, float] = {}

    def after_fork(self) -> None:
        """In a forked child: the lock may have been held by a thread that does
        not exist here, and so may revalidations marked as running."""
        self._lock = threading.Lock()
        for entry in self._entries.values():
            entry.revalidating = False

    def lookup(self, key: CacheKey, now: float) -> Tuple[Optional[CacheEntry], bool]:
        """The entry, and whether the caller must start a revalidation (at most
        one runs per key)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or now < entry.fresh_until or entry.revalidating:
                return entry, False
            entry.revalidating = True
            return entry, True

    def get(self, key: CacheKey) -> Optional[CacheEntry]:
        with self._lock:
            return self._entries.get(key)

    def store(self, key: CacheKey, prompt: Prompt, etag: Optional[str], now: float) -> None:
        with self._lock:
            self._entries[key] = CacheEntry(prompt, etag, now + self.ttl)
            self._unavailable_until.pop(key, None)

    def fetch_failed(self, key: CacheKey, now: float) -> None:
        """A first fetch failed: do not ask again for a moment."""
        with self._lock:
            self._unavailable_until[key] = now + UNAVAILABLE_RETRY_SECS

    def recently_unavailable(self, key: CacheKey, now: float) -> bool:
        with self._lock:
            return now < self._unavailable_until.get(key, 0.0)

    def not_modified(self, key: CacheKey, now: float) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.prompt = replace(entry.prompt, source="server")
                entry.fresh_until = now + self.ttl
                entry.revalidating = False

    def revalidation_failed(self, key: CacheKey, now: float) -> None:
        # Keep serving the last known text; ask again after a short pause
        # rather than on every call while the server is down.
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.prompt = replace(entry.prompt, source="stale")
                entry.fresh_until = now + UNAVAILABLE_RETRY_SECS
                entry.revalidating = False

    def latest_for(self, name: str) -> Optional[Prompt]:
        """The most recently fetched prompt with this name (any label)."""
        with self._lock:
            best: Optional[CacheEntry] = None
            for (n, _, _), e in self._entries.items():
                if n == name and (best is None or e.fresh_until > best.fresh_until):
                    best = e
            return best.prompt if best else None


def prompt_request(name: str, label: Optional[str], subject: Optional[str], etag: Optional[str]) -> Tuple[str, Dict[str, str], Dict[str, str]]:
    """Path, query and headers of ``GET /v1/prompts/{name}``."""
    if not name:
        raise ValueError("a prompt name is required")
    params = {"label": label} if label else {}
    headers: Dict[str, str] = {}
    if subject is not None:
        headers[SUBJECT_HEADER] = subject
    if etag:
        headers["If-None-Match"] = etag
    return f"/v1/prompts/{quote(name, safe='')}", params, headers


def is_unavailable(status: int) -> bool:
    """Answers that mean "try later", not "you are wrong"."""
    return status >= 500 or status in (408, 425, 429)


def api_error(status: int, body: bytes) -> CombeeAPIError:
    """The server's problem+json as an exception (never echoes request data)."""
    title, detail = f"HTTP {status}", None
    try:
        doc = json.loads(body)
        if isinstance(doc, dict):
            title = str(doc.get("title") or title)
            detail = str(doc["detail"]) if doc.get("detail") is not None else None
    except ValueError:
        pass
    return CombeeAPIError(status, title, detail)


def parse_prompt(body: bytes, label: Optional[str], subject: Optional[str]) -> Prompt:
    doc = json.loads(body)
    if not isinstance(doc, dict) or not isinstance(doc.get("text"), str) or not isinstance(doc.get("version"), int):
        raise ValueError("the answer is not a prompt (no `text` and `version`)")
    arm = None
    raw_arm = doc.get("arm")
    if isinstance(raw_arm, str):
        # The server names the arm's role (`champion` / `challenger`) of the
        # prompt's population; the version is the answer's own.
        arm = Arm(version=doc["version"], role=raw_arm, experiment=str(doc.get("name", "")))
    elif isinstance(raw_arm, dict):
        try:
            arm = Arm(version=int(raw_arm["version"]), role=str(raw_arm["role"]), experiment=str(raw_arm["experiment"]))
        except (KeyError, TypeError, ValueError):
            log.warning("ignoring a malformed `arm` in the answer for prompt %r", doc.get("name"))
    labels = doc.get("labels")
    return Prompt(
        name=str(doc.get("name", "")),
        text=doc["text"],
        version=doc["version"],
        label=label,
        labels=tuple(str(x) for x in labels) if isinstance(labels, list) else (),
        arm=arm,
        source="server",
        content_hash=doc.get("content_hash") if isinstance(doc.get("content_hash"), str) else None,
        subject=subject,
        raw=doc,
    )


# ---------------------------------------------------------------- traces


class TraceHandle:
    """What ``log_trace`` returns: a trace on its way to the server.

    The server assigns trace ids (it accepts no client-chosen id), so ``id`` is
    ``None`` until the trace's batch is stored — after ``flush()`` at the
    latest. ``external_id`` is known at once and stored with the trace.
    ``client.feedback(handle, ...)`` works before the id is known: the
    feedback is sent once the trace is stored.
    """

    def __init__(self, external_id: str) -> None:
        self.external_id = external_id
        self._id: Optional[str] = None
        self._status = "queued"
        self._done = threading.Event()

    @property
    def id(self) -> Optional[str]:
        """The server's id of the trace once stored, else ``None``."""
        return self._id

    @property
    def status(self) -> str:
        """``"queued"``, ``"stored"`` or ``"dropped"`` (queue full, rejected, or lost at close)."""
        return self._status

    def wait(self, timeout: Optional[float] = None) -> Optional[str]:
        """Blocks (up to ``timeout`` seconds) until the trace is stored or
        dropped; returns the server id or ``None``. Do not call it from an
        event loop: use ``await client.flush()`` instead."""
        self._done.wait(timeout)
        return self._id

    def _stored(self, trace_id: str) -> None:
        self._id, self._status = trace_id, "stored"
        self._done.set()

    def _dropped(self) -> None:
        self._status = "dropped"
        self._done.set()

    def __repr__(self) -> str:
        return f"TraceHandle(external_id={self.external_id!r}, id={self._id!r}, status={self._status!r})"


def json_safe(value: Any) -> Any:
    """A deep, JSON-encodable copy taken now (later mutation by the agent does
    not change what is sent); unknown objects become their ``str``, and NaN
    and infinities (not JSON: the server would refuse the whole batch) their
    ``str`` too."""
    try:
        return json.loads(json.dumps(value, default=str, allow_nan=False))
    except ValueError:
        return _finite(json.loads(json.dumps(value, default=str)))


def _finite(value: Any) -> Any:
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


FEEDBACK_FIELDS = ("score", "success", "ground_truth", "comment", "error")


def feedback_body(score: Optional[float], success: Optional[bool], ground_truth: Any, comment: Optional[str], error: Optional[str]) -> Dict[str, Any]:
    body: Dict[str, Any] = {}
    if score is not None:
        score = float(score)
        if score != score or score in (float("inf"), float("-inf")):
            raise ValueError("score must be a finite number")
        body["score"] = score
    if success is not None:
        body["success"] = bool(success)
    if ground_truth is not None:
        body["ground_truth"] = json_safe(ground_truth)
    if comment is not None:
        body["comment"] = str(comment)
    if error is not None:
        body["error"] = str(error)
    return body


def trace_body(
    prompt: Union[Prompt, str],
    input: Any,
    output: Any,
    trajectory: Any,
    feedback: Optional[Mapping[str, Any]],
    reflection: Any,
    metadata: Optional[Mapping[str, Any]],
    external_id: str,
    prompt_version: Optional[int],
) -> Dict[str, Any]:
    if isinstance(prompt, Prompt):
        name, version = prompt.name, prompt.version if prompt_version is None else prompt_version
    else:
        name, version = str(prompt), prompt_version
    if input is None:
        raise ValueError("a trace needs an `input` (any JSON value except null)")
    meta: Dict[str, Any] = dict(metadata or {})
    if isinstance(prompt, Prompt) and prompt.arm is not None:
        arm = prompt.arm
        meta.setdefault("arm", {"version": arm.version, "role": arm.role, "experiment": arm.experiment})
    body: Dict[str, Any] = {"prompt": name, "input": input, "external_id": external_id}
    if version is not None:
        body["prompt_version"] = int(version)
    if output is not None:
        body["output"] = output
    if trajectory is not None:
        body["trajectory"] = trajectory
    if feedback:
        unknown = set(feedback) - set(FEEDBACK_FIELDS)
        if unknown:
            raise ValueError(f"unknown feedback fields {sorted(unknown)}; known: {FEEDBACK_FIELDS}")
        body["feedback"] = feedback_body(**{k: feedback.get(k) for k in FEEDBACK_FIELDS})
    if reflection is not None:
        body["reflection"] = reflection
    if meta:
        body["metadata"] = meta
    safe = json_safe(body)
    assert isinstance(safe, dict)
    return safe


@dataclass
class PendingTrace:
    body: Dict[str, Any]
    handle: TraceHandle


@dataclass
class PendingFeedback:
    target: Union[TraceHandle, str]
    body: Dict[str, Any]
    attempts: int = 0


@dataclass
class Batch:
    """Traces sent together under one Idempotency-Key: every retry of the same
    body reuses it, so a batch the server stored but whose answer was lost is
    replayed, not stored twice."""

    traces: List[PendingTrace]
    key: str = field(default_factory=lambda: f"combee-py-{uuid.uuid4()}")
    attempts: int = 0

    def payload(self) -> bytes:
        return json.dumps({"traces": [t.body for t in self.traces]}).encode()


# What to do after an answer to a batch.
@dataclass(frozen=True)
class Stored:
    ids: List[str]


@dataclass(frozen=True)
class Retry:
    reason: str


@dataclass(frozen=True)
class DropOne:
    index: int
    reason: str


@dataclass(frozen=True)
class Split:
    reason: str


@dataclass(frozen=True)
class DropAll:
    reason: str


Outcome = Union[Stored, Retry, DropOne, Split, DropAll]

_TRACE_INDEX = re.compile(r"^traces\[(\d+)\]")


def batch_outcome(status: int, body: bytes, size: int) -> Outcome:
    """Reads the answer to ``POST /v1/traces`` (see src/http/traces.rs)."""
    if status in (200, 201):
        try:
            ids = json.loads(body)["ids"]
            if isinstance(ids, list) and len(ids) == size:
                return Stored([str(i) for i in ids])
        except (ValueError, KeyError, TypeError):
            pass
        return Retry(f"unreadable answer to a stored batch (HTTP {status})")
    # 409: the same key is still in flight on the server; the answer will be replayable.
    if status == 409 or is_unavailable(status):
        return Retry(f"HTTP {status}")
    err = api_error(status, body)
    m = _TRACE_INDEX.match(err.detail or "")
    if m and int(m.group(1)) < size and status in (413, 422):
        return DropOne(int(m.group(1)), str(err))
    if status == 413 and size > 1:
        return Split(str(err))
    return DropAll(str(err))


def backoff(attempt: int, cap: float) -> float:
    """Exponential from 0.1 s, capped, with jitter so many agents do not retry in step."""
    return float(min(cap, 0.1 * 2.0 ** min(attempt, 20)) * random.uniform(0.5, 1.0))


@dataclass
class TraceStats:
    """Counters of the trace queue; read them from ``client.stats``."""

    queued: int = 0
    sent: int = 0
    dropped_queue_full: int = 0
    rejected: int = 0
    lost_at_close: int = 0
    retries: int = 0
    feedback_sent: int = 0
    feedback_dropped: int = 0


class Outbox:
    """The bounded queue between the agent and the sender (thread or task).

    Drop policy: when ``max_queue`` traces are waiting, a new trace is dropped
    (its handle's status becomes ``"dropped"``, ``stats.dropped_queue_full``
    counts it, and a warning is logged once per burst); what is already queued
    is kept. The agent never blocks and ``log_trace`` never raises because of
    the server.
    """

    def __init__(self, batch_size: int, flush_interval: float, max_queue: int) -> None:
        self.cond = threading.Condition()
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.max_queue = max_queue
        self.traces: Deque[PendingTrace] = deque()
        self.feedback: Deque[PendingFeedback] = deque()
        self.oldest_at: Optional[float] = None
        self.in_flight = 0
        self.flushers = 0
        self.closing = False
        self.stats = TraceStats()
        self.wake: Callable[[], None] = lambda: None
        self._warned_full = False

    def put_trace(self, t: PendingTrace) -> bool:
        with self.cond:
            if self.closing:
                log.warning("combee client is closed: dropping trace %s", t.handle.external_id)
                t.handle._dropped()
                return False
            if len(self.traces) >= self.max_queue:
                self.stats.dropped_queue_full += 1
                if not self._warned_full:
                    self._warned_full = True
                    log.warning("combee trace queue is full (%d traces): dropping new traces until it drains", self.max_queue)
                t.handle._dropped()
                return False
            self._warned_full = False
            self.traces.append(t)
            self.stats.queued += 1
            if self.oldest_at is None:
                self.oldest_at = time.monotonic()
            self.cond.notify_all()
        self.wake()
        return True

    def put_feedback(self, f: PendingFeedback) -> bool:
        with self.cond:
            if self.closing:
                log.warning("combee client is closed: dropping feedback")
                return False
            if len(self.feedback) >= self.max_queue:
                self.stats.feedback_dropped += 1
                log.warning("combee feedback queue is full: dropping feedback")
                return False
            self.feedback.append(f)
            self.cond.notify_all()
        self.wake()
        return True

    def take(self, now: float) -> Tuple[Union[Batch, List[PendingFeedback], None], Optional[float]]:
        """Work that is due now, or ``None`` and how long to wait (``None``: until woken)."""
        with self.cond:
            force = self.flushers > 0 or self.closing
            if self.traces:
                due = self.oldest_at is not None and now - self.oldest_at >= self.flush_interval
                if force or due or len(self.traces) >= self.batch_size:
                    n = min(self.batch_size, len(self.traces))
                    batch = Batch([self.traces.popleft() for _ in range(n)])
                    self.oldest_at = now if self.traces else None
                    self.in_flight += 1
                    return batch, None
            ready: List[PendingFeedback] = []
            waiting: Deque[PendingFeedback] = deque()
            for f in self.feedback:
                if isinstance(f.target, str) or f.target.id is not None:
                    ready.append(f)
                elif f.target.status == "dropped":
                    self.stats.feedback_dropped += 1
                    log.warning("dropping feedback for trace %s: the trace was dropped", f.target.external_id)
                else:
                    waiting.append(f)
            self.feedback = waiting
            if ready:
                self.in_flight += 1
                return ready, None
            if self.traces and self.oldest_at is not None:
                return None, max(0.0, self.flush_interval - (now - self.oldest_at))
            return None, None

    def done(self) -> None:
        with self.cond:
            self.in_flight -= 1
            self.cond.notify_all()

    def requeue_feedback(self, items: List[PendingFeedback]) -> None:
        with self.cond:
            self.feedback.extendleft(reversed(items))

    def idle(self) -> bool:
        with self.cond:
            return not self.traces and not self.feedback and self.in_flight == 0

    def pending(self) -> int:
        with self.cond:
            return len(self.traces) + len(self.feedback)

    def abandon(self) -> int:
        """Drops everything still queued (at close, when time ran out)."""
        with self.cond:
            n = len(self.traces)
            for t in self.traces:
                t.handle._dropped()
            self.traces.clear()
            self.stats.lost_at_close += n
            self.stats.feedback_dropped += len(self.feedback)
            self.feedback.clear()
            self.oldest_at = None
            self.cond.notify_all()
            return n

    # -- applying an answer -------------------------------------------------

    def apply(self, batch: Batch, outcome: Outcome) -> Optional[List[Batch]]:
        """Records an answer; returns the batches to send next in place of
        ``batch`` (``None``: retry ``batch`` as it is, same key)."""
        if isinstance(outcome, Retry):
            batch.attempts += 1
            with self.cond:
                self.stats.retries += 1
            return None
        if isinstance(outcome, Stored):
            for t, i in zip(batch.traces, outcome.ids):
                t.handle._stored(i)
            with self.cond:
                self.stats.sent += len(batch.traces)
                self.cond.notify_all()
            self.wake()  # feedback may be waiting for these ids
            return []
        if isinstance(outcome, DropOne):
            bad = batch.traces[outcome.index]
            log.error("combee rejected trace %s, dropping it: %s", bad.handle.external_id, outcome.reason)
            bad.handle._dropped()
            with self.cond:
                self.stats.rejected += 1
            rest = [t for j, t in enumerate(batch.traces) if j != outcome.index]
            return [Batch(rest)] if rest else []
        if isinstance(outcome, Split):
            mid = len(batch.traces) // 2
            return [Batch(batch.traces[:mid]), Batch(batch.traces[mid:])]
        log.error("combee refused a batch of %d traces, dropping it: %s", len(batch.traces), outcome.reason)
        for t in batch.traces:
            t.handle._dropped()
        with self.cond:
            self.stats.rejected += len(batch.traces)
        return []


def feedback_path(f: PendingFeedback) -> str:
    tid = f.target if isinstance(f.target, str) else f.target.id
    return f"/v1/traces/{quote(str(tid), safe='')}/feedback"


def feedback_outcome(f: PendingFeedback, status: int, body: bytes) -> bool:
    """True when the feedback is finished with (stored or refused for good)."""
    if status == 200:
        return True
    if is_unavailable(status):
        f.attempts += 1
        return False
    log.error("combee refused feedback for trace %s: %s", f.target if isinstance(f.target, str) else f.target.id, api_error(status, body))
    return True
