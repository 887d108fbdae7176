"""The requests in flight: their registry, their token streams, cancellation and what they count.

``Requests`` holds one ``RequestRecord`` per admitted request, from admission until its reply
ends, and runs each through the batch runner (:meth:`Requests.stream`). It answers what the
engine is doing (:meth:`Requests.activity`, the input to every "may a rebuild / a stop run
now?") and the ``/admin/requests`` rows. Admission itself is the engine front's (the gate
check and the registration happen under one lock, shared with the gate, so a request is
either refused or registered before a rebuild checks for idleness).

May import ``moetray.engine.cb`` (types), ``moetray.engine.telemetry`` and
``moetray.policy``; never the HTTP layer, the pools' internals or the control operations.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from moetray.engine.cb import BatchRunner, Sampling, TokenLogprob
from moetray.engine.telemetry import Telemetry
from moetray.policy.rebuild import EngineActivity
from moetray.policy.refused import Refused


class EngineUnavailable(Refused):
    """The engine cannot take work for a reason the gate does not express; ``.kind`` is a gate state."""


@dataclass(frozen=True)
class Step:
    """New tokens of one request since the last step; ``finish_reason`` once it is over."""

    tokens: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them


_CANCELLED = object()


@dataclass
class RequestRecord:
    id: str
    prompt_tokens: int
    max_new_tokens: int
    sampling: Sampling
    prompt_ids: list[int]
    created: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    generated: int = 0
    first_token_at: float | None = None
    done: bool = False
    cancelled: bool = False
    cached_tokens: int = 0
    finish_reason: str | None = None  # how it ended: stop / length / cancelled / error
    stopped_by: str | None = None  # who ended it early (wire.FinishedRequest.stopped_by)


class Requests:
    """The registry of requests in flight and the verbs over it (see the module docstring).

    ``runner()`` returns the batch runner serving now (``None`` before the model loaded or
    while a KV re-split has none): it is read at each use, since a re-split replaces it.
    ``model()`` names the served model for the history of finished requests.
    """

    def __init__(
        self,
        lock: threading.RLock,
        clock: Callable[[], float],
        telemetry: Telemetry,
        runner: Callable[[], BatchRunner | None],
        model: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.lock = lock
        self.clock = clock
        self.telemetry = telemetry
        self.runner = runner
        self.model = model
        self._records: dict[str, RequestRecord] = {}

    def register(
        self, rid: str, prompt_ids: list[int], *, max_new_tokens: int, sampling: Sampling
    ) -> RequestRecord:
        """Enter one admitted request (the caller holds the lock and has passed the gate)."""
        with self.lock:
            if rid in self._records:
                raise ValueError(f"request id {rid!r} is already in flight")
            record = RequestRecord(
                id=rid,
                prompt_tokens=len(prompt_ids),
                max_new_tokens=max_new_tokens,
                sampling=sampling,
                prompt_ids=list(prompt_ids),
                created=self.clock(),
            )
            self._records[rid] = record
        return record

    async def stream(self, record: RequestRecord, *, every_step: bool = True) -> AsyncGenerator[Step, None]:
        """Run an admitted request; yields its new tokens step by step until it finishes.

        ``every_step=False`` is for a consumer that only needs the whole reply (a
        non-streaming response with no stop string to watch): the intermediate steps are
        accounted (first token, token counts, ``record.generated``) on the generation thread
        as they happen, without waking this loop, and the stream yields one final ``Step``
        carrying every token (or the cancellation). Leaving the iteration early (the client
        went away, a stop string matched) cancels the request in the batch loop, freeing its
        pages. The record leaves the registry and its tokens enter the totals either way.
        """
        runner = self.runner()
        if runner is None:  # admission saw a runner; a re-split cannot start while this record is in flight
            self.release(record)
            raise EngineUnavailable("failed", "no batch loop serves the admitted request")
        eos_ids = runner.config.eos_token_ids
        finished = False
        seen = 0
        try:
            runner.submit(
                record.id,
                record.prompt_ids,
                max_new_tokens=record.max_new_tokens,
                sampling=record.sampling,
                on_output=record.queue.put_nowait,
                on_progress=None if every_step else (lambda out: self._account(record, out.generated_tokens)),
            )
            while True:
                item = await record.queue.get()
                if item is _CANCELLED:
                    finished = True
                    record.finish_reason = "cancelled"
                    yield Step([], True, "cancelled")
                    return
                tokens = item.generated_tokens
                self._account(record, tokens)
                new = list(tokens[seen:])
                taken = runner.logprobs(record.id)
                logprobs = None if taken is None else taken[seen : len(tokens)]
                seen = len(tokens)
                if item.error is not None:
                    finished = True
                    record.finish_reason, record.stopped_by = "error", "error"
                    raise EngineUnavailable("failed", f"generation failed: {item.error}")
                if item.is_finished():
                    finished = True
                    ended_by_eos = not record.sampling.ignore_eos and tokens and tokens[-1] in eos_ids
                    record.finish_reason = "stop" if ended_by_eos else "length"
                    yield Step(new, True, record.finish_reason, logprobs)
                    return
                if new:
                    yield Step(new, False, logprobs=logprobs)
        finally:
            if not finished:
                runner.cancel(record.id)
                if record.finish_reason is None:  # left early with no stop string: the client went
                    record.finish_reason, record.stopped_by = "cancelled", record.stopped_by or "client"
            record.done = True
            record.cached_tokens = runner.cached_tokens(record.id)
            runner.forget(record.id)
            self.release(record)

    def _account(self, record: RequestRecord, tokens: list[int]) -> None:
        """The request has generated ``tokens`` so far: note its first token and count the new ones.

        Mutates the record and the telemetry; a list no longer than what was counted changes
        nothing. Runs on the loop, or on the generation thread for an ``every_step=False``
        stream (the telemetry is locked; the router's lock orders it before cancellation).
        """
        new = len(tokens) - record.generated
        if new <= 0:
            return
        if record.first_token_at is None:
            record.first_token_at = self.clock()
            self.telemetry.first_token(record.first_token_at - record.created)
        record.generated = len(tokens)
        self.telemetry.tokens(new)

    def release(self, record: RequestRecord) -> None:
        """The reply is over: the request leaves the registry, its tokens join the totals, and
        it joins the history of finished requests."""
        with self.lock:
            if self._records.pop(record.id, None) is None:
                return
        self.telemetry.finished(
            prompt_tokens=record.prompt_tokens,
            completion_tokens=record.generated,
            cached_tokens=record.cached_tokens,
        )
        self.telemetry.record_finished(
            request_id=record.id, model=self.model(), prompt_tokens=record.prompt_tokens,
            completion_tokens=record.generated, created=record.created, first_token_at=record.first_token_at,
            finish_reason=record.finish_reason or ("cancelled" if record.cancelled else "stop"),
            stopped_by=record.stopped_by,
        )

    def abandon(self, request_id: str) -> None:
        """The reply ended without draining its steps (the client vanished): cancel and release now."""
        with self.lock:
            record = self._records.get(request_id)
        if record is None or record.done:
            return
        record.done = True
        record.finish_reason, record.stopped_by = "cancelled", record.stopped_by or "client"
        runner = self.runner()
        if runner is not None:
            runner.cancel(request_id)
            record.cached_tokens = runner.cached_tokens(request_id)
        self.release(record)

    def cancel(self, request_id: str, *, by: str = "admin") -> bool:
        """End one request now, at any point (prefill included); returns whether it was in flight.

        The batch loop frees its pages at the next step boundary; the request's reply ends
        with ``finish_reason: "cancelled"``; ``by`` is recorded as who stopped it
        (``wire.FinishedRequest.stopped_by``).
        """
        with self.lock:
            record = self._records.get(request_id)
        if record is None or record.done:
            return False
        record.cancelled = True
        record.stopped_by = record.stopped_by or by
        runner = self.runner()
        if runner is not None:
            runner.cancel(request_id)
        record.queue.put_nowait(_CANCELLED)
        return True

    def cancel_all(self, *, by: str) -> list[str]:
        """Cancel every request still running, recording ``by`` as who stopped them; returns their ids."""
        with self.lock:
            ids = [rid for rid, rec in self._records.items() if not rec.done]
        return [rid for rid in ids if self.cancel(rid, by=by)]

    # -- what the engine is doing ----------------------------------------------------------------

    def running(self) -> int:
        """How many admitted requests have not finished their reply."""
        with self.lock:
            return sum(1 for rec in self._records.values() if not rec.done)

    def activity(self) -> EngineActivity:
        """What the engine is doing now: registered requests (replies not yet drained included),
        plus any request the batch loop still holds after its reply ended (a cancelled request
        keeps its pages until the loop's next step boundary)."""
        with self.lock:
            records = list(self._records.values())
        runner = self.runner()
        live = {r.request_id: r.state for r in runner.live_requests()} if runner else {}
        prefill = decode = undrained = 0
        for rec in records:
            if rec.done:
                undrained += 1
            elif live.get(rec.id) == "decode" or rec.generated > 0:
                decode += 1
            else:
                prefill += 1
        known = {rec.id for rec in records}
        for rid, state in live.items():
            if rid not in known:
                if state == "decode":
                    decode += 1
                else:
                    prefill += 1
        return EngineActivity(pending_prefill=prefill, running_decode=decode, undrained_replies=undrained)

    async def wait_idle(self, timeout_s: float, *, poll_s: float = 0.01) -> bool:
        """Wait (bounded) until no request is in flight; returns whether the engine went idle."""
        deadline = self.clock() + max(timeout_s, 0.0)
        while not self.activity().is_idle():
            if self.clock() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    def rows(self) -> list[dict[str, Any]]:
        """``policy.wire.ActiveRequest`` rows for every request in flight."""
        with self.lock:
            records = list(self._records.values())
        runner = self.runner()
        live = {r.request_id: r for r in runner.live_requests()} if runner else {}
        now = self.clock()
        rows = []
        for rec in records:
            lr = live.get(rec.id)
            state = lr.state if lr is not None else ("decode" if rec.generated else "queued")
            rows.append(
                {
                    "id": rec.id,
                    "state": state,
                    "tokens": lr.generated if lr else rec.generated,
                    "prompt_tokens": rec.prompt_tokens,
                    "age_s": round(now - rec.created, 3),
                }
            )
        return rows
