"""The device tier: one tensor of ``capacity`` expert rows, and the link that fills it.

:class:`SlotPool` is the device side of the expert cache: ``rows[slot]`` holds one packed
expert (the same row layout as the host store). It moves bytes only when told to; which
expert goes to which slot is decided by :mod:`moetray.policy.moe.expert_cache`, and the
record of which expert's bytes each slot holds is kept by the plan executor,
:mod:`moetray.policy.moe.expert_slots`.

On a CPU-only machine the "device" is host memory and a copy is a real ``memcpy``; an
optional :class:`LinkThrottle` holds each copy to a given GB/s so that timings emulate a
PCIe link. On CUDA the copy is an asynchronous host→device DMA from pinned memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from moetray.engine.experts.codecs import EncodedRow

__all__ = ["LinkThrottle", "SlotPool", "TorchSlotDevice"]


class LinkThrottle:
    """A token bucket that holds transfers to ``gbps`` × 10⁹ bytes/s on average.

    ``transfer(n)`` books ``n`` bytes on the link: the link is busy until
    ``max(now, busy_until) + n / rate``. The caller sleeps only once the booked time runs
    more than ``slack_s`` ahead of the clock, so many tiny copies are not each rounded up
    to the OS's sleep granularity; the long-run rate is exact. Clock and sleep are
    injectable for tests.
    """

    def __init__(self, gbps: float, *, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep, slack_s: float = 2e-4):
        if not gbps > 0:
            raise ValueError(f"link rate must be positive, got {gbps!r} GB/s")  # inf: books, never sleeps
        self.gbps = float(gbps)
        self.rate = self.gbps * 1e9
        self._clock = clock
        self._sleep = sleep
        self.slack_s = slack_s
        self.busy_until = 0.0
        self.booked_bytes = 0
        self.slept_s = 0.0

    def transfer(self, nbytes: int) -> None:
        """Book ``nbytes`` on the link and sleep while the booking runs ahead of the clock."""
        self.book(nbytes)
        self.settle()

    def book(self, nbytes: int) -> None:
        """Book ``nbytes``: the link is busy until ``max(now, busy_until) + nbytes / rate``."""
        now = self._clock()
        self.busy_until = max(now, self.busy_until) + nbytes / self.rate
        self.booked_bytes += nbytes

    def settle(self) -> None:
        """Sleep while the bookings run more than ``slack_s`` ahead of the clock. Called after
        the real copy, so a copy costs ``max(its own time, bytes / rate)``, as a DMA engine
        would, rather than the sum."""
        ahead = self.busy_until - self._clock()
        if ahead > self.slack_s:
            self._sleep(ahead)
            self.slept_s += ahead

    def drain(self) -> None:
        """Wait until every booked byte has "arrived" (end of a timed run)."""
        ahead = self.busy_until - self._clock()
        if ahead > 0:
            self._sleep(ahead)
            self.slept_s += ahead


class SlotPool:
    """``capacity`` packed expert rows on ``device``.

    ``allocate(shape, dtype, device)`` creates row tensors (injectable so a test or the
    rebuild transaction's fault hooks can make it fail). A pool that exists is fully
    allocated; :meth:`allocate_rows` + :meth:`replace_rows` let a resize allocate the new
    rows before anything is torn down.
    """

    def __init__(self, capacity: int, row_numel: int, dtype: torch.dtype, device: torch.device | str,
                 *, throttle: LinkThrottle | None = None,
                 allocate: Callable[..., torch.Tensor] | None = None):
        if capacity < 0:
            raise ValueError(f"capacity must be ≥ 0, got {capacity}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.row_numel = row_numel
        self.throttle = throttle
        self._allocate = allocate or _default_allocate
        self.rows = self.allocate_rows(capacity)
        self.copies = 0
        self.bytes_copied = 0

    @property
    def capacity(self) -> int:
        return self.rows.shape[0]

    @property
    def row_bytes(self) -> int:
        return self.row_numel * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.capacity * self.row_bytes

    def allocate_rows(self, capacity: int) -> torch.Tensor:
        """A new, unfilled ``[capacity, row_numel]`` tensor on the pool's device (may raise)."""
        rows = self._allocate((capacity, self.row_numel), self.dtype, self.device)
        if tuple(rows.shape) != (capacity, self.row_numel) or rows.dtype != self.dtype:
            raise ValueError(f"allocator returned {tuple(rows.shape)} {rows.dtype}, wanted "
                             f"{(capacity, self.row_numel)} {self.dtype}")
        return rows

    def replace_rows(self, rows: torch.Tensor) -> None:
        """Swap in ``rows`` (from :meth:`allocate_rows`); the old tensor is freed when unreferenced."""
        self.rows = rows

    def write(self, slot: int, row: torch.Tensor | EncodedRow) -> None:
        """Copy one packed host row into ``slot``, through the throttle when one is set.

        An :class:`~moetray.engine.experts.codecs.EncodedRow` (a quantized store's) moves its
        stored bytes (``link_bytes``: what the throttle books and ``bytes_copied`` counts) and is
        decoded into the slot on the pool's device."""
        if isinstance(row, EncodedRow):
            moved = row.link_bytes
            if row.codec.decoded_numel != self.row_numel:
                raise ValueError(f"an encoded row of {row.codec.decoded_numel} values does not fit a "
                                 f"slot of {self.row_numel}")
        else:
            moved = self.row_bytes
            if row.numel() != self.row_numel or row.dtype != self.dtype:
                raise ValueError(f"row of {row.numel()} × {row.dtype} does not fit a slot of "
                                 f"{self.row_numel} × {self.dtype}")
        if self.throttle is not None:
            self.throttle.book(moved)
        if isinstance(row, EncodedRow):
            row.decode_into(self.rows[slot], non_blocking=self.device.type == "cuda" and row.data.is_pinned())
        else:
            self.rows[slot].copy_(row, non_blocking=self.device.type == "cuda" and row.is_pinned())
        if self.throttle is not None:
            self.throttle.settle()
        self.copies += 1
        self.bytes_copied += moved


def _default_allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


class TorchSlotDevice:
    """The :class:`~moetray.policy.moe.expert_slots.SlotDevice` protocol over a :class:`SlotPool`.

    ``reserve(n)`` pre-allocates the next pool so that :meth:`resize` (called by the executor
    after the planner has committed to the new size) cannot fail for lack of memory.
    """

    def __init__(self, pool: SlotPool, row_bytes: int):
        self.pool = pool
        self._row_bytes = row_bytes  # what one write carries: the store's row (stored bytes)
        self._reserved: torch.Tensor | None = None

    @property
    def slot_count(self) -> int:
        return self.pool.capacity

    @property
    def row_bytes(self) -> int:
        return self._row_bytes

    def write_slot(self, slot: int, row: torch.Tensor) -> None:
        self.pool.write(slot, row)

    def copy_slot(self, dst: int, src: int) -> None:
        self.pool.rows[dst].copy_(self.pool.rows[src])

    def reserve(self, slot_count: int) -> None:
        self._reserved = self.pool.allocate_rows(slot_count)

    def release_reserved(self) -> None:
        self._reserved = None

    def resize(self, slot_count: int) -> None:
        new = self._reserved if self._reserved is not None and self._reserved.shape[0] == slot_count \
            else self.pool.allocate_rows(slot_count)
        self._reserved = None
        keep = min(slot_count, self.pool.capacity)
        if keep:
            new[:keep].copy_(self.pool.rows[:keep])
        self.pool.replace_rows(new)

    def flush(self) -> None:
        """Copies are ordered before later kernels on the same CUDA stream; on the CPU every
        copy was a synchronous memcpy. Either way nothing needs waiting for here."""
