"""Recording traces from agent code: ``log_trace``, the ``trace`` context
manager and the ``traced`` decorator, shared by both clients."""

from __future__ import annotations

import functools
import inspect
import traceback
import uuid
from typing import Any, Callable, Dict, List, Mapping, Optional, TypeVar, Union, cast

from ._core import FEEDBACK_FIELDS, Outbox, PendingFeedback, PendingTrace, PromptCache, TraceHandle, feedback_body, log, trace_body
from .prompt import Prompt

F = TypeVar("F", bound=Callable[..., Any])


class TraceRecorder:
    """The part of a client that turns agent runs into queued traces."""

    _outbox: Outbox
    _cache: PromptCache

    def _ensure_sender(self) -> None:  # the clients start their thread or task here
        raise NotImplementedError

    def log_trace(
        self,
        prompt: Union[Prompt, str],
        input: Any,
        output: Any = None,
        *,
        trajectory: Any = None,
        feedback: Optional[Mapping[str, Any]] = None,
        reflection: Any = None,
        metadata: Optional[Mapping[str, Any]] = None,
        external_id: Optional[str] = None,
        prompt_version: Optional[int] = None,
    ) -> TraceHandle:
        """Queues one trace and returns at once; a background sender batches it
        to ``POST /v1/traces``.

        ``prompt`` is the :class:`Prompt` the agent ran with (its name and
        version are recorded; for a fallback no version is sent) or a prompt
        name. ``input``, ``output``, ``trajectory``, ``reflection`` are any
        JSON-encodable values (other objects are sent as their ``str``) and are
        copied now. ``feedback`` takes the keys ``score``, ``success``,
        ``ground_truth``, ``comment``, ``error``. ``external_id`` defaults to a
        fresh UUID. Raises ``ValueError`` only for a caller bug (``input`` is
        ``None``, an unknown feedback key); never because of the server.
        """
        ext = external_id or str(uuid.uuid4())
        body = trace_body(prompt, input, output, trajectory, feedback, reflection, metadata, ext, prompt_version)
        handle = TraceHandle(ext)
        if self._outbox.put_trace(PendingTrace(body, handle)):
            self._ensure_sender()
        return handle

    def feedback(
        self,
        trace: Union[TraceHandle, str],
        *,
        score: Optional[float] = None,
        success: Optional[bool] = None,
        ground_truth: Any = None,
        comment: Optional[str] = None,
        error: Optional[str] = None,
    ) -> None:
        """Queues late feedback for a trace (``POST /v1/traces/{id}/feedback``):
        the fields given replace earlier ones. ``trace`` is a server trace id or
        the handle from ``log_trace``; for a handle whose trace is not stored
        yet, the feedback is sent right after it is. Never blocks."""
        if isinstance(trace, str):
            try:
                uuid.UUID(trace)
            except ValueError:
                raise ValueError(f"{trace!r} is not a trace id (the server's ids are UUIDs)") from None
        body = feedback_body(score, success, ground_truth, comment, error)
        if not body:
            raise ValueError(f"give at least one of {', '.join(FEEDBACK_FIELDS)}")
        if self._outbox.put_feedback(PendingFeedback(trace, body)):
            self._ensure_sender()

    def trace(self, prompt: Union[Prompt, str], input: Any, *, metadata: Optional[Mapping[str, Any]] = None) -> "TraceContext":
        """A context manager recording one run::

            with client.trace(prompt, input={"question": q}) as t:
                answer = agent(prompt.compile(...), q)
                t.step({"role": "assistant", "content": answer})
                t.output = answer
                t.feedback(success=True)
            t.handle.id  # after flush()

        An exception inside the block is recorded (``feedback.error``,
        ``success=False`` unless set) and re-raised.
        """
        return TraceContext(self, prompt, input, metadata)

    def traced(self, prompt: Union[Prompt, str]) -> Callable[[F], F]:
        """A decorator recording every call of a function (sync or async) as a
        trace: its bound arguments are the input, its return value the output,
        an exception the error. With a prompt name, the version recorded is the
        one this client fetched most recently for that name (if any)."""

        def resolve() -> Union[Prompt, str]:
            if isinstance(prompt, Prompt):
                return prompt
            return self._cache.latest_for(prompt) or prompt

        def decorate(fn: F) -> F:
            sig = inspect.signature(fn)

            def arguments(args: Any, kwargs: Any) -> Dict[str, Any]:
                try:
                    bound = sig.bind(*args, **kwargs)
                    bound.apply_defaults()
                    return dict(bound.arguments)
                except TypeError:
                    return {"args": list(args), "kwargs": kwargs}

            if inspect.iscoroutinefunction(fn):

                @functools.wraps(fn)
                async def run_async(*args: Any, **kwargs: Any) -> Any:
                    with self.trace(resolve(), arguments(args, kwargs)) as t:
                        t.output = await fn(*args, **kwargs)
                        return t.output

                return cast(F, run_async)

            @functools.wraps(fn)
            def run(*args: Any, **kwargs: Any) -> Any:
                with self.trace(resolve(), arguments(args, kwargs)) as t:
                    t.output = fn(*args, **kwargs)
                    return t.output

            return cast(F, run)

        return decorate


class TraceContext:
    """One run being recorded; see :meth:`TraceRecorder.trace`."""

    def __init__(self, recorder: TraceRecorder, prompt: Union[Prompt, str], input: Any, metadata: Optional[Mapping[str, Any]]) -> None:
        self._recorder = recorder
        self.prompt = prompt
        self.input = input
        self.output: Any = None
        self.trajectory: List[Any] = []
        self.metadata: Dict[str, Any] = dict(metadata or {})
        self.reflection: Any = None
        self._feedback: Dict[str, Any] = {}
        self.handle: Optional[TraceHandle] = None

    def step(self, item: Any) -> None:
        """Appends one message, step or tool call to the trajectory."""
        self.trajectory.append(item)

    def feedback(self, **fields: Any) -> None:
        """Sets feedback fields (``score``, ``success``, ``ground_truth``, ``comment``, ``error``)."""
        unknown = set(fields) - set(FEEDBACK_FIELDS)
        if unknown:
            raise ValueError(f"unknown feedback fields {sorted(unknown)}; known: {FEEDBACK_FIELDS}")
        self._feedback.update(fields)

    def __enter__(self) -> "TraceContext":
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        fb = {k: v for k, v in self._feedback.items() if v is not None}
        if exc is not None:
            fb.setdefault("error", "".join(traceback.format_exception_only(type(exc), exc)).strip()[:4000])
            fb.setdefault("success", False)
        try:
            self.handle = self._recorder.log_trace(
                self.prompt,
                self.input if self.input is not None else {},
                self.output,
                trajectory=self.trajectory or None,
                feedback=fb or None,
                reflection=self.reflection,
                metadata=self.metadata or None,
            )
        except Exception:  # recording must never replace the agent's own outcome
            log.exception("combee could not record a trace")
