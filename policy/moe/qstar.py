"""How many of this step's misses to fetch over the link, and how many to compute on the CPU.

Fetching a missed expert over the host→device link and computing another missed expert on
the CPU (from host memory, where its weights already are) run concurrently, so a step's
miss time is ``max(fetch, cpu)``. With link bandwidth ``B_link`` and CPU expert bandwidth
``B_cpu``, fetching the fraction ``f = B_link / (B_link + B_cpu)`` of the misses makes both
finish together, and the misses are served at ``B_link + B_cpu`` (moe-offload.md §2.1).

The fraction is kept in Q16 fixed point (``round(f · 65536)``) and every split is integer
arithmetic, so the device half and the CPU half of a step agree on it exactly: a one-expert
disagreement would compute an expert twice or not at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from moetray.policy.refused import Refused

__all__ = [
    "Q16",
    "QStarPolicy",
    "QStarRefused",
    "balanced_fetch",
    "fetch_fraction",
    "recommend_backend",
]

Q16 = 1 << 16
Backend = Literal["offload", "hybrid"]


class QStarRefused(Refused, ValueError):
    """``kind`` is ``invalid_fraction``, ``invalid_cap`` or ``invalid_missing``."""


def _q16(fraction: float) -> int:
    return max(0, min(Q16, round(fraction * Q16)))


def balanced_fetch(missing: int, q16: int) -> int:
    """How many of ``missing`` misses to fetch for a Q16 fraction: the balanced choice.

    With ``lo = floor(missing · q)``, picks ``F`` in ``{lo, lo + 1}`` that minimises the
    slower side of the overlap, ``max(F · (1 − q), (missing − F) · q)``; ties go to ``lo``
    (never a plain ceil, which over-fetches: q = 0.415 with 3 misses fetches 1, not 2).
    The result is within one expert of ``q · missing``. Pure.
    """
    lo = (missing * q16) >> 16
    if lo >= missing:
        return missing
    cost_lo = max(lo * (Q16 - q16), (missing - lo) * q16)
    hi = lo + 1
    cost_hi = max(hi * (Q16 - q16), (missing - hi) * q16)
    return hi if cost_hi < cost_lo else lo


@dataclass(frozen=True)
class QStarPolicy:
    """Either a fetch fraction (``q16`` set) or a fixed cap of fetches per step (``cap`` set).

    Build it with `from_fraction` or `fixed_cap`; ``policy.fetch_count`` can be passed as
    ``ExpertCache.ensure(..., fetch_limit=policy.fetch_count)``.
    """

    q16: int | None = None
    cap: int | None = None

    @classmethod
    def from_fraction(cls, fraction: float) -> QStarPolicy:
        """Fetch ``fraction`` of each step's misses (clamped to [0, 1]). Refuses
        ``invalid_fraction`` for NaN, infinities and non-numbers."""
        if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not math.isfinite(fraction):
            raise QStarRefused("invalid_fraction", f"fetch fraction {fraction!r} is not a finite number",
                               fraction=fraction)
        return cls(q16=_q16(float(fraction)))

    @classmethod
    def fixed_cap(cls, n: int = 1) -> QStarPolicy:
        """Fetch at most ``n`` misses per step (0 = the CPU computes every miss); the
        unbenchmarked default is 1. Refuses ``invalid_cap`` for negative or non-integer n."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise QStarRefused("invalid_cap", f"fetch cap {n!r} must be an integer ≥ 0", cap=n)
        return cls(cap=n)

    @property
    def fraction(self) -> float | None:
        """The fetch fraction, or None for a fixed cap."""
        return None if self.q16 is None else self.q16 / Q16

    def split(self, missing: int) -> tuple[int, int]:
        """``(fetch, cpu)`` for ``missing`` distinct misses: ``fetch + cpu == missing``.

        Pure. Refuses ``invalid_missing`` for a negative or non-integer count.
        """
        if isinstance(missing, bool) or not isinstance(missing, int) or missing < 0:
            raise QStarRefused("invalid_missing", f"missing {missing!r} must be an integer ≥ 0",
                               missing=missing)
        if self.q16 is not None:
            fetch = balanced_fetch(missing, self.q16)
        else:
            fetch = min(self.cap or 0, missing)
        return fetch, missing - fetch

    def fetch_count(self, missing: int) -> int:
        """The ``fetch`` half of `split` (the shape ``ExpertCache.ensure``'s ``fetch_limit`` takes)."""
        return self.split(missing)[0]


def fetch_fraction(link_bw: float | None, cpu_bw: float | None, *, overlapped: bool = True) -> float | None:
    """The fetch fraction from measured bandwidths, or None when either is unusable.

    ``overlapped=True`` (both measured while the other ran, the preferred figures):
    ``link / (link + cpu)``. Standalone figures assume the two paths contend fully for
    DRAM: ``min(1, link / cpu)``. A missing, non-positive or non-finite figure gives None
    (unknown, never 0). Pure.
    """
    if not _positive(link_bw) or not _positive(cpu_bw):
        return None
    assert link_bw is not None and cpu_bw is not None
    if overlapped:
        return link_bw / (link_bw + cpu_bw)
    return min(1.0, link_bw / cpu_bw)


def recommend_backend(cpu_bw: float | None, link_bw: float | None, threshold: float = 2.0) -> Backend:
    """``"hybrid"`` only when the CPU beats the link by a real margin
    (``cpu_bw > threshold × link_bw``); otherwise, or when either figure is unknown,
    ``"offload"`` (always safe). Pure."""
    if not _positive(cpu_bw) or not _positive(link_bw) or not _positive(threshold):
        return "offload"
    assert cpu_bw is not None and link_bw is not None
    return "hybrid" if cpu_bw > threshold * link_bw else "offload"


def _positive(value: float | None) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)
