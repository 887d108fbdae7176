"""What a process actually costs in host memory: PSS where the kernel gives it, RSS otherwise.

PSS (proportional set size) divides each shared page among the processes mapping it, so
it can be summed over a process group; RSS counts a shared page in full in every
process (two workers sharing a 40 GiB mapping would report 80 GiB). The kind always
travels with the number: comparing PSS with RSS reads as a leak.

Nothing here opens a file: the probes take a ``read_text(path) -> str | None`` reader
(``None`` when the file cannot be read), and the cache takes a clock. Unknown is
``None``, never 0.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

__all__ = [
    "Footprint",
    "FootprintKind",
    "ProbeCache",
    "RSS_PARTS",
    "own_memory",
    "parse_smaps_rollup_pss",
    "parse_stat_pgid",
    "parse_status_rss",
    "parse_status_rss_parts",
    "probe_footprint",
    "probe_group_footprint",
    "process_group",
    "sum_footprints",
]

ReadText = Callable[[str], "str | None"]
T = TypeVar("T")


class FootprintKind(StrEnum):
    PSS = "pss"
    RSS = "rss"


@dataclass(frozen=True)
class Footprint:
    """A memory figure in bytes and which kind of figure it is."""

    bytes: int
    kind: FootprintKind

    def to_wire(self) -> dict[str, object]:
        """``policy.wire.Footprint``: ``{"bytes": int, "kind": "pss" | "rss"}``."""
        return {"bytes": self.bytes, "kind": self.kind.value}


def _parse_kb_field(text: str | None, key: str) -> int | None:
    """Bytes of the first ``key:`` line, which must read ``<digits> kB``; else ``None``."""
    if not text:
        return None
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        if not sep or name.strip() != key:
            continue
        parts = rest.split()
        if len(parts) != 2 or parts[1] != "kB" or not parts[0].isdigit():
            return None
        return int(parts[0]) * 1024
    return None


def parse_smaps_rollup_pss(text: str | None) -> int | None:
    """Bytes of PSS from ``/proc/<pid>/smaps_rollup`` text (its first ``Pss:`` line, already summed).

    The unit must be ``kB``. Missing field, malformed number, other or missing unit, or
    no text → ``None``; never raises, never 0 for unknown.
    """
    return _parse_kb_field(text, "Pss")


def parse_status_rss(text: str | None) -> int | None:
    """Bytes of RSS from ``/proc/<pid>/status`` text (``VmRSS:``); same rules as the PSS parser."""
    return _parse_kb_field(text, "VmRSS")


RSS_PARTS = {"RssAnon": "rss_anon", "RssFile": "rss_file", "RssShmem": "rss_shmem"}
"""The kernel's parts of a process's RSS (``/proc/<pid>/status`` fields) and their keys: memory of
its own (the heap, tensors), pages of mapped files (libraries, and a model file a server maps
rather than reads, as llama.cpp does) and shared memory."""


def parse_status_rss_parts(text: str | None) -> dict[str, int | None]:
    """Bytes of each of :data:`RSS_PARTS` from ``/proc/<pid>/status`` text, each by the PSS parser's
    rules (``None`` where unknown)."""
    return {key: _parse_kb_field(text, field) for field, key in RSS_PARTS.items()}


def own_memory(parts: Mapping[str, int | None]) -> int | None:
    """A process's RSS less its mapped files' pages (:func:`parse_status_rss_parts`): what it holds
    itself, shared memory included (moetray's KV pool is an anonymous shared mapping); ``None`` if
    either part is unknown."""
    anon, shmem = parts.get("rss_anon"), parts.get("rss_shmem")
    return None if anon is None or shmem is None else anon + shmem


def parse_stat_pgid(text: str | None) -> int | None:
    """The process group id from ``/proc/<pid>/stat`` text, or ``None`` when unreadable.

    The command name sits in parentheses and may itself contain spaces or parentheses,
    so fields are counted after the last ``)``: state, ppid, then pgrp.
    """
    if not text:
        return None
    close = text.rfind(")")
    if close < 0:
        return None
    fields = text[close + 1 :].split()
    if len(fields) < 3:
        return None
    try:
        return int(fields[2])
    except ValueError:
        return None


def probe_footprint(pid: int | str, read_text: ReadText) -> Footprint | None:
    """This process's footprint: PSS from ``smaps_rollup`` if readable, else RSS from ``status``.

    ``pid`` is a number or ``"self"``. Reads through ``read_text`` only; ``None`` when
    neither file yields a figure (gone, not Linux, not permitted).
    """
    pss = parse_smaps_rollup_pss(read_text(f"/proc/{pid}/smaps_rollup"))
    if pss is not None:
        return Footprint(pss, FootprintKind.PSS)
    rss = parse_status_rss(read_text(f"/proc/{pid}/status"))
    if rss is not None:
        return Footprint(rss, FootprintKind.RSS)
    return None


def process_group(root_pid: int, candidate_pids: Iterable[int], read_text: ReadText) -> tuple[int, ...]:
    """The root and every candidate whose process group is the root's pid, in ascending order.

    The engine runs as its own session and group leader, so its workers share its pid as
    their group id. A candidate whose ``stat`` cannot be read (it exited) is left out;
    the root is always included. Mutates nothing.
    """
    members = {root_pid}
    for pid in candidate_pids:
        if pid != root_pid and parse_stat_pgid(read_text(f"/proc/{pid}/stat")) == root_pid:
            members.add(pid)
    return tuple(sorted(members))


def sum_footprints(footprints: Iterable[Footprint | None]) -> Footprint | None:
    """The total of a group's footprints, or ``None`` when any member (or the whole group) is unknown.

    A partial sum presented as the group's total would understate it, so one unknown
    member makes the total unknown. Refuses to add PSS to RSS (``ValueError``): the sum
    would be neither.
    """
    items = list(footprints)
    known = [f for f in items if f is not None]
    if not items or len(known) < len(items):
        return None
    kinds = {f.kind for f in known}
    if len(kinds) > 1:
        raise ValueError(f"cannot add footprints of different kinds: {sorted(k.value for k in kinds)}")
    return Footprint(sum(f.bytes for f in known), kinds.pop())


def probe_group_footprint(pids: Iterable[int], read_text: ReadText) -> Footprint | None:
    """A process group's footprint: PSS summed when every member has PSS, else RSS summed, else ``None``.

    Falling back for the whole group keeps the kinds consistent (RSS over-counts shared
    pages, and says so by its kind). ``None`` for an empty group or when some member has
    neither figure.
    """
    pids = list(pids)
    if not pids:
        return None
    pss = [b for pid in pids
           if (b := parse_smaps_rollup_pss(read_text(f"/proc/{pid}/smaps_rollup"))) is not None]
    if len(pss) == len(pids):
        return Footprint(sum(pss), FootprintKind.PSS)
    rss = [b for pid in pids if (b := parse_status_rss(read_text(f"/proc/{pid}/status"))) is not None]
    if len(rss) == len(pids):
        return Footprint(sum(rss), FootprintKind.RSS)
    return None


class ProbeCache(Generic[T]):
    """Shares one probe among concurrent readers for ``ttl_s`` seconds of ``clock()``.

    A PSS probe walks every mapping of the process; a dashboard polling at 1 Hz from
    several places would otherwise pay for it each time.
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        if ttl_s < 0:
            raise ValueError(f"ttl_s must not be negative, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._value: T | None = None
        self._at: float | None = None

    def get_or_probe(self, probe: Callable[[], T | None]) -> T | None:
        """The cached value if younger than the TTL, else a fresh ``probe()``; mutates the cache.

        A successful probe is cached with the time it was taken. A failed probe
        (``None``) is returned as ``None``: it is not cached, and not papered over with an
        older value. The lock is held across the probe, so concurrent callers collapse
        onto one read.
        """
        with self._lock:
            now = self._clock()
            if self._at is not None and now - self._at < self.ttl_s:
                return self._value
            value = probe()
            if value is None:
                self._value, self._at = None, None
                return None
            self._value, self._at = value, now
            return value
