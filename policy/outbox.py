"""What a stop reports, once, however many times it is retried.

The order is the rule: the gate seals the totals, the receipt is made durable, and only
then is the stop signalled (in the HTTP server the reply is the signal). Reversed, a
crash between the signal and the write loses a whole engine generation's totals.

A receipt's id is derived, not random: the same engine identity always yields the same
id, so a retried stop re-persists the same file instead of creating a second one.

``FileOutbox`` is this package's one writer of files. It takes its directory from the
caller and does nothing but the atomic write of one receipt, so it stays testable on a
real temporary directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from moetray.policy.maintenance import SealedAccounting
from moetray.policy.refused import Refused

__all__ = [
    "RECEIPT_NAMESPACE",
    "FileOutbox",
    "Receipt",
    "ReceiptStatus",
    "StopFailure",
    "finish_stop",
    "receipt_id",
]

RECEIPT_NAMESPACE = b"moetray/outbox/receipt/v1"
"""Domain of receipt ids; change it only with the encoding, so old ids can never be misread."""

_ID_PATTERN = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-8[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def receipt_id(identity: str) -> str:
    """The receipt id of an engine identity: deterministic and UUID-shaped (8-4-4-4-12 lowercase hex).

    SHA-256 over ``RECEIPT_NAMESPACE``, a zero byte and the UTF-8 identity; the first 16
    bytes, with the version nibble set to 8 (RFC 9562 "custom": a SHA-256 derivation
    labelled v5 would claim SHA-1) and the RFC 4122 variant bits. The zero byte keeps
    namespace and identity apart. Pure.
    """
    digest = bytearray(hashlib.sha256(RECEIPT_NAMESPACE + b"\0" + identity.encode("utf-8")).digest()[:16])
    digest[6] = (digest[6] & 0x0F) | 0x80  # version 8
    digest[8] = (digest[8] & 0x3F) | 0x80  # variant 10xx
    h = digest.hex()
    return f"{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class ReceiptStatus(StrEnum):
    COMPLETE = "complete"  # drained: the totals are exact
    DEGRADED = "degraded"  # the drain did not complete: the totals are a lower bound


@dataclass(frozen=True)
class Receipt:
    """The durable record of one stopped engine generation."""

    id: str
    model_id: str | None
    prompt_tokens_total: int
    completion_tokens_total: int
    uptime_seconds: float
    status: ReceiptStatus

    @classmethod
    def from_sealed(cls, identity: str, sealed: SealedAccounting) -> Receipt:
        """The receipt for ``identity``'s sealed totals, ``degraded`` when the drain did not complete.

        The demotion happens here, at the boundary, so no consumer can forget it; a
        degraded receipt still reports its totals.
        """
        return cls(
            id=receipt_id(identity),
            model_id=sealed.model_id,
            prompt_tokens_total=sealed.prompt_tokens_total,
            completion_tokens_total=sealed.completion_tokens_total,
            uptime_seconds=sealed.uptime_seconds,
            status=ReceiptStatus.COMPLETE if sealed.drain_complete else ReceiptStatus.DEGRADED,
        )

    def to_json(self) -> dict[str, object]:
        """The receipt as a JSON object (a new dict)."""
        return {
            "id": self.id,
            "model_id": self.model_id,
            "prompt_tokens_total": self.prompt_tokens_total,
            "completion_tokens_total": self.completion_tokens_total,
            "uptime_seconds": self.uptime_seconds,
            "status": self.status.value,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Receipt:
        """Reads back ``to_json``'s shape; raises ``KeyError``/``ValueError`` on anything else."""
        return cls(
            id=str(data["id"]),
            model_id=data["model_id"],
            prompt_tokens_total=int(data["prompt_tokens_total"]),
            completion_tokens_total=int(data["completion_tokens_total"]),
            uptime_seconds=float(data["uptime_seconds"]),
            status=ReceiptStatus(data["status"]),
        )

    def to_bytes(self) -> bytes:
        """The canonical file content: sorted keys, so a retry writes byte-identical JSON."""
        return (json.dumps(self.to_json(), sort_keys=True, indent=2) + "\n").encode("utf-8")


class StopFailure(Refused):
    """The stop's receipt did not make it through persist-then-signal.

    ``.kind`` is ``not_persisted`` (nothing was signalled; a retry reseals the same totals
    under the same id) or ``not_signalled`` (the receipt is durable, only the signal
    failed). ``.receipt`` is the receipt and ``.cause`` the underlying exception.
    """

    KINDS = ("not_persisted", "not_signalled")

    def __init__(self, kind: str, receipt: Receipt, cause: BaseException) -> None:
        if kind == "not_persisted":
            message = f"stop receipt {receipt.id} could not be written ({cause}); nothing was signalled"
        else:
            message = f"stop receipt {receipt.id} is durable but the signal failed ({cause})"
        super().__init__(kind, message, receipt=receipt, cause=cause)


def finish_stop(
    receipt: Receipt,
    persist: Callable[[Receipt], object],
    signal: Callable[[Receipt], object],
) -> Receipt:
    """Makes ``receipt`` durable, then signals it; returns the receipt.

    Calls ``persist(receipt)`` first and ``signal(receipt)`` only once it returned.
    ``persist`` must be idempotent by id (a retried stop persists the same receipt again).
    Refuses with ``StopFailure``: ``not_persisted`` when persist raised (signal never
    called), ``not_signalled`` when signal raised (the message says the receipt is durable).
    """
    try:
        persist(receipt)
    except Exception as failure:
        raise StopFailure("not_persisted", receipt, failure) from failure
    try:
        signal(receipt)
    except Exception as failure:
        raise StopFailure("not_signalled", receipt, failure) from failure
    return receipt


class FileOutbox:
    """Receipts as ``<directory>/<id>.json``, written atomically and at most once per id."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def path_for(self, receipt_id: str) -> Path:
        """Where the receipt with this id lives; refuses an id that is not receipt-shaped (``ValueError``)."""
        if not _ID_PATTERN.match(receipt_id):
            raise ValueError(f"not a receipt id: {receipt_id!r}")
        return self.directory / f"{receipt_id}.json"

    def persist(self, receipt: Receipt) -> Path:
        """Makes ``receipt`` durable; idempotent by id. Returns the file's path.

        An existing file for the id is success and is left untouched (never a second
        file, never a rewrite). Otherwise the JSON goes to a temporary file in the same
        directory, is fsynced, atomically renamed onto ``<id>.json`` and the directory
        fsynced. No temporary file survives, success or failure. Creates the directory
        if needed. Raises ``OSError`` when the write fails, ``ValueError`` for a malformed id.
        """
        final = self.path_for(receipt.id)
        if final.exists():
            return final
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{receipt.id}.", suffix=".partial")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(receipt.to_bytes())
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        _fsync_directory(self.directory)
        return final

    def load(self, receipt_id: str) -> Receipt | None:
        """The persisted receipt with this id, or ``None`` when there is none. Mutates nothing."""
        path = self.path_for(receipt_id)
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        return Receipt.from_json(data)


def _fsync_directory(directory: Path) -> None:
    # Makes the rename itself durable. Best effort: some filesystems refuse to open a
    # directory for fsync, and the file's own data was already synced.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
