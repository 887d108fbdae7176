"""Stopping everything: ``POST /admin/prepare-stop {drain_timeout_s?, abort_timeout_s?}``.

Order: gate ``begin_stop`` (admission closes for good; refused only during a rebuild) →
drain (bounded wait for the requests in flight to finish) → abort whatever is left (each
cancelled at its next step boundary) and wait for the abort barrier (bounded) → gate
``seal`` (the totals are fixed once; a retry gets the identical value) → the receipt is
made durable by ``outbox.finish_stop`` (persist first, then the reply is the signal) → the
reply carries the receipt, and counts the requests that were in flight when the stop began:
``drained`` (finished on their own) and ``aborted`` (cancelled after the drain timed out).
A retried stop returns the same receipt and counts, and the outbox directory holds one file.

The flow gets the gate (``engine.gate.Gate``) and the request registry, never the engine.
May import those rooms, ``platformdirs`` and ``moetray.policy``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moetray.engine.gate import Gate
from moetray.engine.requests import Requests
from moetray.policy.maintenance import SealedAccounting
from moetray.policy.outbox import FileOutbox, Receipt, finish_stop

log = logging.getLogger("moetray.engine.stop")

DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_ABORT_TIMEOUT_S = 5.0


def default_outbox_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_state_dir("moetray")) / "outbox"


async def prepare_stop(
    gate: Gate,
    requests: Requests,
    *,
    identity: str,
    accounting: Callable[[], SealedAccounting],
    drain_timeout_s: float | None,
    abort_timeout_s: float | None,
    outbox: FileOutbox,
) -> dict[str, Any]:
    """Stop the engine's work and return the receipt body; raises the gate's / outbox's refusals.

    ``identity`` names this engine in the receipt; ``accounting`` gives the totals the gate seals.
    """
    in_flight = gate.begin_stop(requests.running)  # StopRefused("rebuild_in_progress"): nothing changed
    drain = DEFAULT_DRAIN_TIMEOUT_S if drain_timeout_s is None else max(float(drain_timeout_s), 0.0)
    drained = await requests.wait_idle(drain)
    aborted = 0
    if not drained:
        aborted = requests.cancel_all()
        await requests.wait_idle(
            DEFAULT_ABORT_TIMEOUT_S if abort_timeout_s is None else max(abort_timeout_s, 0.0)
        )

    def still_active() -> int:
        activity = requests.activity()
        return activity.pending_prefill + activity.running_decode + activity.undrained_replies

    counts = {"drained": max(in_flight - aborted, 0), "aborted": aborted}
    sealed, counts = gate.seal(still_active, snapshot=accounting, counts=counts)
    receipt = Receipt.from_sealed(identity, sealed)
    # In an HTTP server the reply is the signal: the receipt is on disk before we answer.
    finish_stop(receipt, persist=outbox.persist, signal=lambda r: None)
    log.info("stopped: receipt %s (%s), %d aborted", receipt.id, receipt.status.value, aborted)
    body = sealed.to_json()
    body.update(counts)
    body.update(
        {
            "receipt": receipt.to_json(),
            "receipt_id": receipt.id,
            "receipt_status": receipt.status.value,
            "receipt_path": str(outbox.path_for(receipt.id)),
        }
    )
    return body
