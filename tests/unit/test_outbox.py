"""Rules of the stop outbox: derived receipt ids, persist before signal, one atomic file per id."""

from __future__ import annotations

import hashlib
import os
import re
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moetray.policy import outbox
from moetray.policy.maintenance import MaintenanceGate, SealedAccounting
from moetray.policy.outbox import (
    RECEIPT_NAMESPACE,
    FileOutbox,
    Receipt,
    ReceiptStatus,
    StopFailure,
    finish_stop,
    receipt_id,
)

SEALED = SealedAccounting(
    "tiny-moe", prompt_tokens_total=120, completion_tokens_total=250, uptime_seconds=9.75
)
IDENTITY = "pid:4242:started:1764700000"
UUID_SHAPE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def independent_receipt_id(identity: str) -> str:
    """The derivation of issue 2, written a second way (integer masks through the uuid module)."""
    value = int.from_bytes(
        hashlib.sha256(RECEIPT_NAMESPACE + b"\x00" + identity.encode()).digest()[:16], "big"
    )
    value &= ~(0xF000 << 64)  # clear the version nibble (bits 76..79)
    value |= 0x8000 << 64  # version 8
    value &= ~(0xC000 << 48)  # clear the two variant bits (bits 62..63)
    value |= 0x8000 << 48  # RFC 4122 variant 10
    return str(uuid.UUID(int=value))


# --- receipt ids --------------------------------------------------------------------------


def test_receipt_id_is_deterministic_and_uuid_shaped():
    """A random id would make a retried stop write a second receipt for the same engine."""
    rid = receipt_id(IDENTITY)
    assert rid == receipt_id(IDENTITY)
    assert rid != receipt_id(IDENTITY + "x")
    assert len(rid) == 36 and UUID_SHAPE.match(rid)


def test_receipt_id_version_and_variant():
    """Labelling a SHA-256 derivation v5 would claim SHA-1 and mislead anyone re-deriving it."""
    groups = receipt_id(IDENTITY).split("-")
    assert groups[2][0] == "8"
    assert groups[3][0] in "89ab"
    assert uuid.UUID(receipt_id(IDENTITY)).variant == uuid.RFC_4122


def test_receipt_id_matches_an_independent_derivation():
    """Dropping the zero separator or changing the namespace would silently orphan every stored receipt."""
    for identity in (IDENTITY, "", "é", "a" * 1000):
        assert receipt_id(identity) == independent_receipt_id(identity)


def test_receipt_id_is_pinned():
    """A change of namespace or encoding must be a deliberate act that also fails this pin."""
    assert receipt_id("pid:1:started:0") == independent_receipt_id("pid:1:started:0")
    assert receipt_id("pid:1:started:0") == "23437bfc-6610-8a25-8a90-5fbb4ddbe946"


@given(st.text(max_size=64), st.text(max_size=64))
def test_distinct_identities_get_distinct_well_formed_ids(a, b):
    """Property: every id is UUID-shaped with version 8, and distinct identities do not collide."""
    for identity in (a, b):
        rid = receipt_id(identity)
        assert UUID_SHAPE.match(rid) and rid[14] == "8" and rid[19] in "89ab"
    assert (receipt_id(a) == receipt_id(b)) == (a == b)


# --- receipts -----------------------------------------------------------------------------


def test_complete_seal_gives_a_complete_receipt():
    """The receipt is what a supervisor bills from; its fields must be the sealed totals exactly."""
    receipt = Receipt.from_sealed(IDENTITY, SEALED)
    assert receipt == Receipt(receipt_id(IDENTITY), "tiny-moe", 120, 250, 9.75, ReceiptStatus.COMPLETE)


def test_undrained_seal_is_demoted_to_degraded_but_keeps_totals():
    """A consumer that forgot to check drain_complete would treat lower-bound totals as exact."""
    receipt = Receipt.from_sealed(IDENTITY, SealedAccounting("m", 1, 250, 3.0, drain_complete=False))
    assert receipt.status is ReceiptStatus.DEGRADED
    assert receipt.completion_tokens_total == 250


def test_receipt_json_round_trip():
    """The tray reads receipts back from disk; a lossy encoding would change the totals it shows."""
    receipt = Receipt.from_sealed(IDENTITY, SEALED)
    assert Receipt.from_json(receipt.to_json()) == receipt
    assert receipt.to_json()["status"] == "complete"


# --- finish_stop --------------------------------------------------------------------------


class Recorder:
    def __init__(self, persist_error: str | None = None, signal_error: str | None = None) -> None:
        self.calls: list[str] = []
        self.persist_error, self.signal_error = persist_error, signal_error

    def persist(self, receipt):
        self.calls.append("persist")
        if self.persist_error:
            raise OSError(self.persist_error)

    def signal(self, receipt):
        self.calls.append("signal")
        if self.signal_error:
            raise ConnectionError(self.signal_error)


def test_persist_comes_before_signal():
    """Signalling first and crashing before the write loses an engine generation's totals."""
    recorder = Recorder()
    receipt = Receipt.from_sealed(IDENTITY, SEALED)
    assert finish_stop(receipt, recorder.persist, recorder.signal) is receipt
    assert recorder.calls == ["persist", "signal"]


def test_failed_persist_never_signals():
    """A stop signalled without a durable receipt would look complete while its totals are gone."""
    recorder = Recorder(persist_error="disk full")
    with pytest.raises(StopFailure) as failure:
        finish_stop(Receipt.from_sealed(IDENTITY, SEALED), recorder.persist, recorder.signal)
    assert failure.value.kind == "not_persisted"
    assert "disk full" in str(failure.value.cause)
    assert recorder.calls == ["persist"]


def test_failed_signal_says_the_receipt_is_durable():
    """Without "durable" in the message an operator would hunt for a receipt that is already on disk."""
    recorder = Recorder(signal_error="peer gone")
    receipt = Receipt.from_sealed(IDENTITY, SEALED)
    with pytest.raises(StopFailure) as failure:
        finish_stop(receipt, recorder.persist, recorder.signal)
    assert failure.value.kind == "not_signalled"
    assert failure.value.receipt == receipt
    assert "durable" in str(failure.value)


# --- FileOutbox -----------------------------------------------------------------------------


def test_persist_writes_one_json_file_named_by_id(tmp_path):
    """The tray finds a receipt by its id; any other name would make it unreachable."""
    receipt = Receipt.from_sealed(IDENTITY, SEALED)
    path = FileOutbox(tmp_path / "outbox").persist(receipt)
    assert path == tmp_path / "outbox" / f"{receipt.id}.json"
    assert os.listdir(tmp_path / "outbox") == [f"{receipt.id}.json"]
    assert FileOutbox(tmp_path / "outbox").load(receipt.id) == receipt


def test_retried_persist_leaves_the_first_file_untouched(tmp_path):
    """A retry that rewrote the file could replace exact totals with different ones, or race a reader."""
    box = FileOutbox(tmp_path)
    first = Receipt.from_sealed(IDENTITY, SEALED)
    box.persist(first)
    stat = os.stat(box.path_for(first.id))
    content = box.path_for(first.id).read_bytes()
    later = Receipt.from_sealed(IDENTITY, SealedAccounting("tiny-moe", 999, 999, 99.0))  # same id
    box.persist(later)
    assert box.path_for(first.id).read_bytes() == content
    assert os.stat(box.path_for(first.id)).st_ino == stat.st_ino
    assert os.listdir(tmp_path) == [f"{first.id}.json"]


def test_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    """A leftover temp file would be mistaken for a receipt or pile up with every failed stop."""

    def failing_fsync(fd):
        raise OSError("I/O error")

    monkeypatch.setattr(outbox.os, "fsync", failing_fsync)
    box = FileOutbox(tmp_path)
    receipt = Receipt.from_sealed(IDENTITY, SEALED)
    with pytest.raises(OSError):
        box.persist(receipt)
    assert os.listdir(tmp_path) == []
    assert box.load(receipt.id) is None


def test_outbox_refuses_ids_that_are_not_receipt_ids(tmp_path):
    """A crafted id like ../x would write outside the outbox directory."""
    box = FileOutbox(tmp_path)
    with pytest.raises(ValueError):
        box.persist(Receipt("../escape", None, 0, 0, 0.0, ReceiptStatus.COMPLETE))
    assert os.listdir(tmp_path) == []


def test_retried_stop_end_to_end_gives_one_receipt(tmp_path):
    """Issue 2's stop path: seal, persist, signal; a retry returns the same receipt and leaves one file."""
    gate = MaintenanceGate.serving()
    box = FileOutbox(tmp_path)
    replies = []
    for totals in (SEALED, SealedAccounting("tiny-moe", 1, 2, 3.0)):
        gate.begin_stop()
        sealed = gate.seal(0, False, lambda totals=totals: totals)
        replies.append(finish_stop(Receipt.from_sealed(IDENTITY, sealed), box.persist, lambda r: None))
    assert replies[0] == replies[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{replies[0].id}.json"]
    assert box.load(replies[0].id).completion_tokens_total == 250
