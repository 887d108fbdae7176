"""Applying the planner's copy plans to a slot device, validated before any write.

`ExpertSlots` is the executor between `moetray.policy.moe.expert_cache.ExpertCache` (which
decides) and a `SlotDevice` (which holds one row of bytes per slot). Expert bytes come from
an `ExpertRows` source (the host tier). One expert is one contiguous row of ``row_bytes``
(all of its projections packed together), so one miss is one copy.

The executor keeps its own occupant map, separate from the planner's: a disagreement
between the two reveals a copy that failed. The rules, in order, for `ExpertSlots.apply`:

1. validate the **whole** plan (layer and experts in range, copy slots in range, no slot
   written twice, every row present with exactly ``row_bytes``, every routed slot either
   copied now or already holding that expert's bytes) — a refusal changes nothing;
2. write each row (the slot's occupant is cleared before its write);
3. flush; a failed flush marks **every** slot written by the plan unknown, and a failed
   write marks the plan's written slots and the failing one unknown. The caller then calls
   ``ExpertCache.forget_slot`` for each slot in the error's ``unknown_slots``.

`HostSlotMemory` is the real CPU backend (a bytearray; the "link" is a memcpy). The engine
provides a torch-tensor device with the same protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

from moetray.policy.refused import Refused

__all__ = [
    "UNKNOWN",
    "ApplyReport",
    "ExpertRows",
    "ExpertSlots",
    "HostSlotMemory",
    "RowsFromCallable",
    "SlotDevice",
    "SlotDeviceError",
    "SlotPlanRefused",
    "SlotStats",
    "row_nbytes",
]


@runtime_checkable
class ExpertRows(Protocol):
    """Who provides expert bytes: the host tier (memory-mapped checkpoint, pinned bank…).

    ``row(layer, expert)`` returns one expert's packed row (any object with ``nbytes`` or
    the buffer protocol: bytes, memoryview, a numpy array, a torch tensor), or None when the
    source has no such row. It must not mutate the source's notion of which rows exist.
    """

    # Read-only (a property or a plain attribute both fit).
    @property
    def num_layers(self) -> int: ...

    @property
    def num_experts(self) -> int: ...

    @property
    def row_bytes(self) -> int: ...

    def row(self, layer: int, expert: int) -> Any | None: ...


@runtime_checkable
class SlotDevice(Protocol):
    """Where slots live: ``slot_count`` rows of ``row_bytes`` each.

    - ``write_slot(slot, row)`` copies one row into a slot (may be asynchronous);
    - ``copy_slot(dst, src)`` copies one slot's row into another (used by resize);
    - ``resize(slot_count)`` truncates or extends the pool, keeping slots below the new size;
    - ``flush()`` returns when every earlier write has landed, or raises.

    Any exception a device raises is reported as `SlotDeviceError`.
    """

    # Read-only (a property or a plain attribute both fit).
    @property
    def slot_count(self) -> int: ...

    @property
    def row_bytes(self) -> int: ...

    def write_slot(self, slot: int, row: Any) -> None: ...

    def copy_slot(self, dst: int, src: int) -> None: ...

    def resize(self, slot_count: int) -> None: ...

    def flush(self) -> None: ...


class _Unknown:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Any = _Unknown()
"""Occupant of a slot whose write or flush failed: its bytes belong to nobody."""


class SlotPlanRefused(Refused, ValueError):
    """The plan failed validation; nothing was written. ``kind`` is one of
    ``geometry_mismatch``, ``layer_out_of_range``, ``expert_out_of_range``,
    ``slot_out_of_range``, ``slot_written_twice``, ``expert_copied_twice``, ``missing_row``,
    ``row_size``, ``length_mismatch``, ``stale_slot``; offending values are attributes."""


class SlotDeviceError(Refused, RuntimeError):
    """The device failed mid-plan. ``kind`` is ``device_write`` (``slot`` names the failing
    slot), ``device_copy`` or ``device_flush``; ``unknown_slots`` lists every slot whose
    bytes can no longer be trusted (now `UNKNOWN` in the executor's map)."""

    KINDS = ("device_write", "device_copy", "device_flush")
    slot: int | None  # set by ``Refused`` from the keyword arguments below
    unknown_slots: tuple[int, ...]

    def __init__(self, kind: str, message: str, *, slot: int | None,
                 unknown_slots: Sequence[int]) -> None:
        super().__init__(kind, message, slot=slot, unknown_slots=tuple(unknown_slots))


class ApplyReport(NamedTuple):
    rows: int  # rows copied by this plan
    bytes: int  # bytes copied by this plan


class SlotStats(NamedTuple):
    plans: int = 0  # plans applied successfully
    warm_plans: int = 0  # of which copied nothing
    rows: int = 0
    bytes: int = 0

    @property
    def warm_plan_rate(self) -> float | None:
        """Share of plans that copied nothing; None before any plan."""
        return self.warm_plans / self.plans if self.plans else None


def row_nbytes(row: Any) -> int:
    """Byte length of a row: its ``nbytes`` (numpy, torch, memoryview) or its buffer's size."""
    nbytes = getattr(row, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    return memoryview(row).nbytes


class ExpertSlots:
    """The executor: keeps which expert's bytes each slot holds and applies plans to a device.

    ``ExpertSlots(device, rows)`` refuses ``geometry_mismatch`` when the device's and the
    source's ``row_bytes`` differ, or either is not positive.
    """

    def __init__(self, device: SlotDevice, rows: ExpertRows) -> None:
        if device.row_bytes != rows.row_bytes or device.row_bytes <= 0 or device.slot_count < 0:
            raise SlotPlanRefused("geometry_mismatch", f"device rows of {device.row_bytes} B × "
                                  f"{device.slot_count} slots vs source rows of {rows.row_bytes} B",
                                  device_row_bytes=device.row_bytes, source_row_bytes=rows.row_bytes)
        self.device = device
        self.rows = rows
        self._occupant: list[Any] = [None] * device.slot_count
        self._stats = SlotStats()

    @property
    def slot_count(self) -> int:
        return len(self._occupant)

    def occupant(self, slot: int) -> tuple[int, int] | None | Any:
        """``(layer, expert)`` whose bytes are in ``slot``, None if empty, `UNKNOWN` after a failure."""
        return self._occupant[slot]

    def unknown_slots(self) -> list[int]:
        return [s for s, o in enumerate(self._occupant) if o is UNKNOWN]

    def stats(self) -> SlotStats:
        return self._stats

    def disagreements(self, occupant_of: Callable[[int], tuple[int, int] | None]) -> list[int]:
        """Slots whose planner occupant (``occupant_of(slot)``, e.g. ``ExpertCache.occupant``)
        differs from the bytes this executor wrote. Empty slots on the planner's side are
        fine whatever the bytes. Mutates nothing."""
        out = []
        for slot, mine in enumerate(self._occupant):
            theirs = occupant_of(slot)
            if theirs is not None and theirs != mine:
                out.append(slot)
        return out

    def forget(self, slot: int) -> None:
        """Mark ``slot`` empty (the planner dropped it). Mutates the occupant map only."""
        self._occupant[slot] = None

    def validate(self, plan: Any) -> list[tuple[int, int, Any]]:
        """Check a plan (an ``ExpertPlan``: ``layer``, ``expert_ids``, ``slots``, ``copies``)
        against the device and the current occupants; return ``(slot, expert, row)`` to write.

        Mutates nothing. Refuses with `SlotPlanRefused` (see its kinds).
        """
        rows = self.rows
        layer = plan.layer
        if not 0 <= layer < rows.num_layers:
            raise SlotPlanRefused("layer_out_of_range", f"layer {layer} not in [0, {rows.num_layers})",
                                  layer=layer)
        if len(plan.slots) != len(plan.expert_ids):
            raise SlotPlanRefused("length_mismatch", f"{len(plan.slots)} slots for "
                                  f"{len(plan.expert_ids)} routed ids", slots=len(plan.slots),
                                  routed=len(plan.expert_ids))
        n = len(self._occupant)
        written: dict[int, int] = {}
        experts_copied: set[int] = set()
        todo: list[tuple[int, int, Any]] = []
        for slot, expert in plan.copies:
            if not 0 <= slot < n:
                raise SlotPlanRefused("slot_out_of_range", f"copy to slot {slot} not in [0, {n})",
                                      slot=slot, slot_count=n)
            if not 0 <= expert < rows.num_experts:
                raise SlotPlanRefused("expert_out_of_range", f"expert {expert} not in "
                                      f"[0, {rows.num_experts})", expert=expert)
            if slot in written:
                raise SlotPlanRefused("slot_written_twice", f"slot {slot} written twice (experts "
                                      f"{written[slot]} and {expert})", slot=slot)
            if expert in experts_copied:
                raise SlotPlanRefused("expert_copied_twice", f"expert {expert} copied twice",
                                      expert=expert)
            row = rows.row(layer, expert)
            if row is None:
                raise SlotPlanRefused("missing_row", f"no row for layer {layer} expert {expert}",
                                      layer=layer, expert=expert)
            size = row_nbytes(row)
            if size != rows.row_bytes:
                raise SlotPlanRefused("row_size", f"row of layer {layer} expert {expert} has {size} B, "
                                      f"slots take exactly {rows.row_bytes} B", layer=layer,
                                      expert=expert, size=size, row_bytes=rows.row_bytes)
            written[slot] = expert
            experts_copied.add(expert)
            todo.append((slot, expert, row))
        for expert, slot in zip(plan.expert_ids, plan.slots, strict=True):
            if slot is None:
                continue
            if not 0 <= slot < n:
                raise SlotPlanRefused("slot_out_of_range", f"route to slot {slot} not in [0, {n})",
                                      slot=slot, slot_count=n)
            holds = (layer, written[slot]) if slot in written else self._occupant[slot]
            if holds != (layer, expert):
                raise SlotPlanRefused("stale_slot", f"layer {layer} expert {expert} routed to slot "
                                      f"{slot}, which holds {holds!r}", slot=slot, layer=layer,
                                      expert=expert, holds=holds)
        return todo

    def apply(self, plan: Any) -> ApplyReport:
        """Validate ``plan`` whole, then copy its rows into their slots and flush.

        Mutates the device and the occupant map. Refuses with `SlotPlanRefused` before any
        write; raises `SlotDeviceError` (with ``unknown_slots``) when the device fails.
        """
        todo = self.validate(plan)
        layer = plan.layer
        done: list[int] = []
        for slot, expert, row in todo:
            self._occupant[slot] = None  # cleared before the write: never half-trusted
            try:
                self.device.write_slot(slot, row)
            except Exception as exc:
                bad = [*done, slot]
                for s in bad:
                    self._occupant[s] = UNKNOWN
                raise SlotDeviceError("device_write", f"writing slot {slot} failed: {exc}", slot=slot,
                                      unknown_slots=bad) from exc
            self._occupant[slot] = (layer, expert)
            done.append(slot)
        if done:
            self._flush(done)
        nbytes = len(done) * self.rows.row_bytes
        stats = self._stats
        self._stats = SlotStats(stats.plans + 1, stats.warm_plans + (0 if done else 1),
                                stats.rows + len(done), stats.bytes + nbytes)
        return ApplyReport(len(done), nbytes)

    def apply_resize(self, plan: Any) -> ApplyReport:
        """Apply a ``ResizePlan``: copy each ``(src, dst)`` move, resize the device, flush.

        Validates first (sources and destinations in range, destinations below the new
        capacity and distinct, no destination is a source, every source's bytes known) and
        refuses with `SlotPlanRefused` before any change. A device failure marks the moved
        slots unknown and raises `SlotDeviceError`.
        """
        n, new = len(self._occupant), plan.capacity
        if new < 0:
            raise SlotPlanRefused("slot_out_of_range", f"capacity {new} < 0", slot=new, slot_count=n)
        dsts: set[int] = set()
        srcs = {src for src, _ in plan.moves}
        for src, dst in plan.moves:
            if not 0 <= src < n or not 0 <= dst < min(n, new):
                raise SlotPlanRefused("slot_out_of_range", f"move {src} → {dst} outside [0, {n}) / "
                                      f"[0, {new})", slot=dst, slot_count=n)
            if dst in dsts or dst in srcs:
                raise SlotPlanRefused("slot_written_twice", f"slot {dst} written twice", slot=dst)
            owner = self._occupant[src]
            if owner is None or owner is UNKNOWN:
                raise SlotPlanRefused("stale_slot", f"move from slot {src}, which holds {owner!r}",
                                      slot=src, holds=owner)
            dsts.add(dst)
        moved: list[int] = []
        try:
            for src, dst in plan.moves:
                self._occupant[dst] = None
                moved.append(dst)
                self.device.copy_slot(dst, src)
                self._occupant[dst] = self._occupant[src]
            self.device.resize(new)
            self.device.flush()
        except Exception as exc:
            for s in moved:
                self._occupant[s] = UNKNOWN
            kind = "device_copy"
            raise SlotDeviceError(kind, f"resize to {new} slots failed: {exc}", slot=None,
                                  unknown_slots=[s for s in moved if s < new]) from exc
        finally:
            if len(self._occupant) != self.device.slot_count:
                # keep the map the size of the device, whatever happened
                size = self.device.slot_count
                self._occupant = (self._occupant + [None] * size)[:size]
        return ApplyReport(len(moved), len(moved) * self.rows.row_bytes)

    def _flush(self, written: list[int]) -> None:
        try:
            self.device.flush()
        except Exception as exc:
            for s in written:
                self._occupant[s] = UNKNOWN
            raise SlotDeviceError("device_flush", f"flush failed after writing {len(written)} slots: "
                                  f"{exc}", slot=None, unknown_slots=written) from exc


class HostSlotMemory:
    """A real host-memory slot device: one bytearray of ``slot_count × row_bytes``.

    Writes are synchronous memcpys, so ``flush`` has nothing to wait for. ``read_slot``
    returns a copy of a slot's bytes; ``view`` a zero-copy memoryview of it.
    """

    def __init__(self, slot_count: int, row_bytes: int) -> None:
        if slot_count < 0 or row_bytes <= 0:
            raise ValueError(f"need slot_count ≥ 0 and row_bytes > 0, got {slot_count}, {row_bytes}")
        self.slot_count = slot_count
        self.row_bytes = row_bytes
        self._buf = bytearray(slot_count * row_bytes)
        self.writes = 0  # rows written through write_slot (not copy_slot)

    def _span(self, slot: int) -> slice:
        if not 0 <= slot < self.slot_count:
            raise IndexError(f"slot {slot} not in [0, {self.slot_count})")
        return slice(slot * self.row_bytes, (slot + 1) * self.row_bytes)

    def write_slot(self, slot: int, row: Any) -> None:
        data = memoryview(row).cast("B")
        if data.nbytes != self.row_bytes:
            raise ValueError(f"row of {data.nbytes} B, slots take {self.row_bytes} B")
        self._buf[self._span(slot)] = data
        self.writes += 1

    def copy_slot(self, dst: int, src: int) -> None:
        self._buf[self._span(dst)] = self._buf[self._span(src)]

    def resize(self, slot_count: int) -> None:
        if slot_count < 0:
            raise ValueError(f"slot_count {slot_count} < 0")
        size = slot_count * self.row_bytes
        if size < len(self._buf):
            del self._buf[size:]
        else:
            self._buf.extend(bytes(size - len(self._buf)))
        self.slot_count = slot_count

    def flush(self) -> None:
        """Nothing is in flight: every write above was a synchronous memcpy."""

    def read_slot(self, slot: int) -> bytes:
        return bytes(self._buf[self._span(slot)])

    def view(self, slot: int) -> memoryview:
        return memoryview(self._buf)[self._span(slot)]


@dataclass(frozen=True)
class RowsFromCallable:
    """An `ExpertRows` over a reader function ``read(layer, expert) -> row | None``.

    The reader does the I/O (a memory map, a file, a dict); this adapter adds the geometry.
    """

    num_layers: int
    num_experts: int
    row_bytes: int
    read: Callable[[int, int], Any]

    def row(self, layer: int, expert: int) -> Any | None:
        return self.read(layer, expert)
