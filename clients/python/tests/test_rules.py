"""The pure rules behind the sender: how each answer to a batch is read, and
when the outbox hands out a batch. No server needed."""

from __future__ import annotations

import json

from combee._core import Batch, DropAll, DropOne, Outbox, PendingTrace, Retry, Split, Stored, TraceHandle, batch_outcome


def problem(status: int, detail: str) -> bytes:
    return json.dumps({"type": "about:blank", "title": "x", "status": status, "detail": detail}).encode()


def test_answers_to_a_batch() -> None:
    assert batch_outcome(201, b'{"ids": ["a", "b"], "count": 2}', 2) == Stored(["a", "b"])
    assert isinstance(batch_outcome(201, b'{"ids": ["a"]}', 2), Retry)  # not an answer to this batch
    for status in (408, 409, 425, 429, 500, 502, 503):
        assert isinstance(batch_outcome(status, problem(status, "later"), 2), Retry), status
    assert batch_outcome(422, problem(422, 'traces[1]: unknown prompt "nope"'), 2) == DropOne(1, 'HTTP 422 x: traces[1]: unknown prompt "nope"')
    assert isinstance(batch_outcome(413, problem(413, "traces[0]: the trace is 300000 bytes"), 2), DropOne)
    assert isinstance(batch_outcome(413, problem(413, "the body is too large"), 2), Split)
    assert isinstance(batch_outcome(413, problem(413, "the body is too large"), 1), DropAll)
    assert isinstance(batch_outcome(401, problem(401, "bad key"), 2), DropAll)
    assert isinstance(batch_outcome(422, problem(422, "traces[7]: out of range"), 2), DropAll)


def pending(n: int) -> PendingTrace:
    return PendingTrace({"prompt": "p", "input": n}, TraceHandle(str(n)))


def test_the_outbox_batches_by_size_or_age_and_drops_new_traces_when_full() -> None:
    box = Outbox(batch_size=3, flush_interval=1.0, max_queue=4)
    for i in range(2):
        assert box.put_trace(pending(i))
    work, wait = box.take(box.oldest_at or 0.0)
    assert work is None and wait == 1.0  # neither full nor old enough
    assert box.put_trace(pending(2))
    work, _ = box.take(0.0)
    assert isinstance(work, Batch) and [t.body["input"] for t in work.traces] == [0, 1, 2]
    for i in range(3, 7):
        assert box.put_trace(pending(i))
    late = pending(7)
    assert not box.put_trace(late) and late.handle.status == "dropped" and box.stats.dropped_queue_full == 1
    work, _ = box.take(float("inf"))  # old enough: a batch even if not full
    assert isinstance(work, Batch) and len(work.traces) == 3
    assert box.apply(work, Split("too big")) is not None
    again = box.apply(work, Retry("503"))
    assert again is None and work.attempts == 1
