"""Rules of the footprint probe: PSS preferred, RSS fallback, kind always reported, unknown is None."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from bounded import join
from hypothesis import given
from hypothesis import strategies as st

from moetray.policy.footprint import (
    Footprint,
    FootprintKind,
    ProbeCache,
    own_memory,
    parse_smaps_rollup_pss,
    parse_stat_pgid,
    parse_status_rss,
    parse_status_rss_parts,
    probe_footprint,
    probe_group_footprint,
    process_group,
    sum_footprints,
)

ROLLUP = """\
5555c7f98000-7ffffa6e6000 ---p 00000000 00:00 0                          [rollup]
Rss:              614400 kB
Pss:              524288 kB
Pss_Dirty:          1120 kB
Pss_Anon:           1120 kB
Pss_File:            970 kB
Shared_Clean:       1616 kB
"""
STATUS = "Name:\tmoetray\nUmask:\t0022\nState:\tS (sleeping)\nVmPeak:\t  9000 kB\nVmRSS:\t    4096 kB\n"


def fake_proc(files: dict[str, str]):
    """A read_text over a dict of /proc paths; missing paths read as None, like an unreadable file."""
    return files.get


# --- parsers --------------------------------------------------------------------------------


def test_rollup_pss_in_bytes():
    """Reporting kB as bytes would understate the engine's memory 1024 times."""
    assert parse_smaps_rollup_pss(ROLLUP) == 524288 * 1024


def test_pss_parser_ignores_pss_dirty_and_friends():
    """Matching by prefix would read Pss_Dirty when the order of lines differs between kernels."""
    text = "Pss_Dirty:   1 kB\nPss_Anon:   2 kB\nPss:   3 kB\n"
    assert parse_smaps_rollup_pss(text) == 3 * 1024


def test_status_rss_in_bytes():
    """The RSS fallback must be in the same unit as the PSS path."""
    assert parse_status_rss(STATUS) == 4096 * 1024


def test_status_rss_parts_in_bytes_each_unknown_on_its_own():
    """RSS split as the kernel does (own memory, mapped files, shared), each in bytes; a part the
    text lacks is unknown while the others stay read."""
    text = STATUS + "RssAnon:\t    3000 kB\nRssFile:\t    1000 kB\n"
    want = {"rss_anon": 3000 * 1024, "rss_file": 1000 * 1024, "rss_shmem": None}
    assert parse_status_rss_parts(text) == want
    assert parse_status_rss_parts(None) == {"rss_anon": None, "rss_file": None, "rss_shmem": None}


def test_own_memory_is_anonymous_plus_shared_and_unknown_if_either_is():
    """A process's own memory leaves its mapped files out (llama.cpp maps its model file) and keeps
    shared anonymous memory in (moetray's KV pool); a part unknown makes it unknown, never 0."""
    parts = {"rss_anon": 800, "rss_file": 120, "rss_shmem": 40}
    assert own_memory(parts) == 840
    assert own_memory({**parts, "rss_shmem": None}) is None


@pytest.mark.parametrize(
    "text",
    [
        None,
        "",
        "Rss: 10 kB\n",
        "Pss: lots kB\n",
        "Pss: 10 mB\n",
        "Pss: 10\n",
        "Pss: -10 kB\n",
        "Pss: 1.5 kB\n",
    ],
    ids=["none", "empty", "missing", "non-number", "wrong-unit", "no-unit", "negative", "fraction"],
)
def test_malformed_or_missing_reads_as_unknown(text):
    """A 0 presented as a fact reads as "the engine costs nothing"; unknown must be None."""
    assert parse_smaps_rollup_pss(text) is None
    assert parse_status_rss(None if text is None else text.replace("Pss", "VmRSS")) is None


@given(st.text(max_size=200))
def test_parsers_never_raise(text):
    """Property: any text, including garbage from a racing process exit, yields bytes or None."""
    for parse in (parse_smaps_rollup_pss, parse_status_rss, parse_stat_pgid):
        result = parse(text)
        assert result is None or isinstance(result, int)


def test_stat_pgid_survives_a_command_name_with_spaces_and_parens():
    """Splitting naively on spaces would read the wrong field for a worker named "(x) y"."""
    assert parse_stat_pgid("1234 (py (x) y) S 1 777 777 0 -1 4194304") == 777
    assert parse_stat_pgid("1234 (python) S") is None


# --- probes ---------------------------------------------------------------------------------


def test_probe_prefers_pss():
    """RSS over-counts shared mappings (the memory-mapped expert store), so PSS wins when available."""
    read = fake_proc({"/proc/42/smaps_rollup": ROLLUP, "/proc/42/status": STATUS})
    assert probe_footprint(42, read) == Footprint(524288 * 1024, FootprintKind.PSS)


def test_probe_falls_back_to_rss_and_says_so():
    """A fallback that did not report its kind would make RSS read as an honest PSS (or as a leak)."""
    read = fake_proc({"/proc/42/status": STATUS})
    assert probe_footprint(42, read) == Footprint(4096 * 1024, FootprintKind.RSS)


def test_probe_of_an_unreadable_process_is_unknown():
    """A gone process must read as unknown, not as 0 bytes."""
    assert probe_footprint(42, fake_proc({})) is None


def test_probe_reads_this_real_process():
    """The parsers must accept what this kernel actually writes, not only our samples."""

    def read_text(path: str) -> str | None:
        try:
            return Path(path).read_text()
        except OSError:
            return None

    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc on this platform")
    footprint = probe_footprint("self", read_text)
    assert footprint is not None
    assert footprint.bytes > 1024 * 1024  # a Python interpreter with pytest loaded
    assert footprint.to_wire()["kind"] in ("pss", "rss")


# --- groups ---------------------------------------------------------------------------------


def test_process_group_keeps_root_and_members_only():
    """Counting another session's processes would bill the engine for memory it does not use."""
    read = fake_proc(
        {
            "/proc/10/stat": "10 (moetray) S 1 10 10",
            "/proc/11/stat": "11 (worker) S 10 10 10",
            "/proc/12/stat": "12 (bash) S 1 12 12",
        }
    )
    assert process_group(10, [12, 11, 10, 13], read) == (10, 11)


def test_group_sums_pss_when_every_member_has_it():
    """PSS divides shared pages, so only a PSS sum is the group's honest cost."""
    read = fake_proc({"/proc/1/smaps_rollup": "Pss: 10 kB\n", "/proc/2/smaps_rollup": "Pss: 20 kB\n"})
    assert probe_group_footprint([1, 2], read) == Footprint(30 * 1024, FootprintKind.PSS)


def test_group_falls_back_to_rss_for_every_member():
    """Adding one member's RSS to another's PSS gives a number of no kind at all."""
    read = fake_proc(
        {
            "/proc/1/smaps_rollup": "Pss: 10 kB\n",
            "/proc/1/status": "VmRSS: 15 kB\n",
            "/proc/2/status": "VmRSS: 25 kB\n",
        }
    )
    assert probe_group_footprint([1, 2], read) == Footprint(40 * 1024, FootprintKind.RSS)


def test_group_with_an_unmeasurable_member_is_unknown():
    """A partial sum shown as the group total would understate what the engine costs."""
    read = fake_proc({"/proc/1/smaps_rollup": "Pss: 10 kB\n", "/proc/1/status": "VmRSS: 15 kB\n"})
    assert probe_group_footprint([1, 2], read) is None
    assert probe_group_footprint([], read) is None


def test_sum_footprints_refuses_mixed_kinds():
    """The sum of a PSS and an RSS is neither; refusing names the caller's bug."""
    with pytest.raises(ValueError):
        sum_footprints([Footprint(1, FootprintKind.PSS), Footprint(2, FootprintKind.RSS)])


def test_sum_footprints_is_unknown_if_any_part_is():
    """Unknown plus known is unknown, never the known part alone."""
    assert sum_footprints([Footprint(1, FootprintKind.PSS), None]) is None
    assert sum_footprints([]) is None
    assert sum_footprints([Footprint(1, FootprintKind.RSS)] * 3) == Footprint(3, FootprintKind.RSS)


# --- ProbeCache ---------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CountingProbe:
    def __init__(self, *values):
        self.values = list(values)
        self.calls = 0

    def __call__(self):
        value = self.values[min(self.calls, len(self.values) - 1)]
        self.calls += 1
        return value


def test_cache_serves_within_ttl_and_reprobes_at_ttl():
    """Probing on every poll walks every mapping each second; never reprobing shows stale memory."""
    clock, probe = Clock(), CountingProbe(1, 2)
    cache = ProbeCache(ttl_s=1.0, clock=clock)
    for t in (0.0, 0.1, 0.999):
        clock.now = t
        assert cache.get_or_probe(probe) == 1
    assert probe.calls == 1
    clock.now = 1.0
    assert cache.get_or_probe(probe) == 2
    assert probe.calls == 2


def test_failed_probe_is_not_cached_nor_papered_over():
    """Showing the last good value after a failure hides that the figure is unknown now."""
    clock, probe = Clock(), CountingProbe(7, None, 8)
    cache = ProbeCache(ttl_s=0.1, clock=clock)
    assert cache.get_or_probe(probe) == 7
    clock.now = 0.1
    assert cache.get_or_probe(probe) is None  # not 7
    clock.now = 0.101
    assert cache.get_or_probe(probe) == 8  # the failure was not cached
    assert probe.calls == 3


def test_concurrent_readers_share_one_probe():
    """Several pollers each walking smaps at once would multiply the probe's cost by the reader count."""
    started = threading.Event()
    calls = []

    def slow_probe():
        calls.append(1)
        started.set()
        time.sleep(0.05)  # held inside the lock: the others must wait, then reuse the value
        return Footprint(1, FootprintKind.PSS)

    cache = ProbeCache(ttl_s=60.0, clock=time.monotonic)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(cache.get_or_probe(slow_probe))) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        join(thread, 30, "a reader of the shared probe")
    assert len(calls) == 1
    assert results == [Footprint(1, FootprintKind.PSS)] * 4
