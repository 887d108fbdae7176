"""Stopping everything: ``POST /admin/prepare-stop {drain_timeout_s?, abort_timeout_s?}``.

Order: gate ``begin_stop`` (admission closes for good; refused only during a rebuild) →
drain (bounded wait for the requests in flight to finish) → abort whatever is left (each
cancelled at its next step boundary) and wait for the abort barrier (bounded) → gate
``seal`` (the totals are fixed once; a retry gets the identical value) → the receipt is
made durable by ``outbox.finish_stop`` (persist first, then the reply is the signal) → the
reply carries the receipt, and counts the requests that were in flight when the stop began:
``drained`` (finished on their own) and ``aborted`` (cancelled after the drain timed out).
A retried stop returns the same receipt and counts, and the outbox directory holds one file.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from moetray.engine.core import Engine
from moetray.policy.outbox import FileOutbox, Receipt, finish_stop

log = logging.getLogger("moetray.engine.stop")

DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_ABORT_TIMEOUT_S = 5.0


def default_outbox_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_state_dir("moetray")) / "outbox"


async def prepare_stop(
    engine: Engine, *, drain_timeout_s: float | None, abort_timeout_s: float | None, outbox: FileOutbox
) -> dict[str, Any]:
    """Stop the engine's work and return the receipt body; raises the gate's / outbox's refusals."""
    with engine.lock:
        engine.gate.begin_stop()  # StopRefused("rebuild_in_progress"): nothing changed
        in_flight = sum(1 for rec in engine.registry.values() if not rec.done)
    drain = DEFAULT_DRAIN_TIMEOUT_S if drain_timeout_s is None else max(float(drain_timeout_s), 0.0)
    drained = await engine.wait_idle(drain)
    aborted = 0
    if not drained:
        with engine.lock:
            ids = [rid for rid, rec in engine.registry.items() if not rec.done]
        for rid in ids:
            aborted += engine.cancel(rid)
        await engine.wait_idle(
            DEFAULT_ABORT_TIMEOUT_S if abort_timeout_s is None else max(abort_timeout_s, 0.0)
        )
    with engine.lock:
        activity = engine.activity()
        active = activity.pending_prefill + activity.running_decode + activity.undrained_replies
        sealed = engine.gate.seal(active, had_identities=True, snapshot=engine.sealed_accounting)
    if engine.stop_counts is None:  # the first stop that sealed fixes them; retries repeat them
        engine.stop_counts = {"drained": max(in_flight - aborted, 0), "aborted": aborted}
    receipt = Receipt.from_sealed(engine.identity, sealed)
    # In an HTTP server the reply is the signal: the receipt is on disk before we answer.
    finish_stop(receipt, persist=outbox.persist, signal=lambda r: None)
    log.info("stopped: receipt %s (%s), %d aborted", receipt.id, receipt.status.value, aborted)
    body = sealed.to_json()
    body.update(engine.stop_counts)
    body.update(
        {
            "receipt": receipt.to_json(),
            "receipt_id": receipt.id,
            "receipt_status": receipt.status.value,
            "receipt_path": str(outbox.path_for(receipt.id)),
        }
    )
    return body
