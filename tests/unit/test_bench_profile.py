"""Rules of the bandwidth profile: one file per device, never borrowed, written atomically."""

from __future__ import annotations

import json
import os

import pytest

from moetray.policy.moe.bench_profile import (
    BandwidthProfile,
    DeviceIdentity,
    ProfileRefused,
    load_profile,
    profile_path,
    save_profile,
)

H200 = DeviceIdentity("cuda", "NVIDIA H200", "GPU-1a2b3c4d-0000-1111-2222-333344445555")
TWIN = DeviceIdentity("cuda", "NVIDIA H200", "GPU-99999999-0000-1111-2222-333344445555")
CPU = DeviceIdentity("cpu", "AMD EPYC 7B13")


def profile(device=H200, link=50.0, cpu=20.0, **kw) -> BandwidthProfile:
    return BandwidthProfile(device=device, link_gbs=link, cpu_gbs=cpu, **kw)


def test_round_trip_on_this_device(tmp_path):
    saved = profile(expert_bytes=9_437_184, measured_unix=1_700_000_000, link_label="pinned H2D")
    path = save_profile(tmp_path, saved)
    found = load_profile(tmp_path, H200)
    assert found.status == "ok" and found.profile == saved and found.path == path


def test_path_is_per_device_not_per_machine(tmp_path):
    # Two identical cards in different slots have different links.
    assert profile_path(tmp_path, H200) != profile_path(tmp_path, TWIN)
    assert profile_path(tmp_path, H200).endswith("gpu-1a2b3c4d-0000-1111-2222-333344445555.json")
    assert os.path.basename(profile_path(tmp_path, CPU)) == "cpu-amd-epyc-7b13.json"


def test_missing_profile_is_reported_as_missing(tmp_path):
    found = load_profile(tmp_path, H200)
    assert found.status == "missing" and found.profile is None


def test_another_devices_numbers_are_never_borrowed(tmp_path):
    save_profile(tmp_path, profile(device=TWIN))
    assert load_profile(tmp_path, H200).status == "missing"
    # Even when pointed at it explicitly, a profile of the twin card is refused.
    found = load_profile(tmp_path, H200, explicit_path=profile_path(tmp_path, TWIN))
    assert found.status == "foreign" and found.profile is None


def test_a_renamed_file_from_another_device_is_foreign(tmp_path):
    path = save_profile(tmp_path, profile(device=TWIN))
    os.replace(path, profile_path(tmp_path, H200))
    assert load_profile(tmp_path, H200).status == "foreign"


@pytest.mark.parametrize("text", ["{not json", "[]", '{"version": 99}', "",
                                  '{"version": 1, "device": {"kind": "cuda"}}'])
def test_a_corrupt_profile_stops_the_lookup(tmp_path, text):
    path = profile_path(tmp_path, H200)
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as fh:
        fh.write(text)
    found = load_profile(tmp_path, H200)
    assert found.status == "corrupt" and found.profile is None


def test_impossible_numbers_on_disk_are_corrupt(tmp_path):
    path = save_profile(tmp_path, profile())
    data = json.loads(open(path).read())
    data["link_gbs"] = -3
    with open(path, "w") as fh:
        json.dump(data, fh)
    assert load_profile(tmp_path, H200).status == "corrupt"


def test_save_is_atomic_and_leaves_no_partial_file(tmp_path, monkeypatch):
    path = save_profile(tmp_path, profile(link=10.0))

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        save_profile(tmp_path, profile(link=99.0))
    monkeypatch.undo()
    assert load_profile(tmp_path, H200).profile.link_gbs == 10.0
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]


def test_construction_refuses_bad_measurements():
    for kw, kind in [({"link": 0.0}, "not_positive"), ({"cpu": float("nan")}, "not_positive"),
                     ({"link_overlap_gbs": 5.0}, "only_one_side"),
                     ({"link_overlap_gbs": 5.0, "cpu_overlap_gbs": -1.0}, "not_positive")]:
        with pytest.raises(ProfileRefused) as err:
            profile(**kw)
        assert err.value.kind == kind
    with pytest.raises(ProfileRefused) as err:
        DeviceIdentity("cuda", "")
    assert err.value.kind == "invalid_device"


def test_backend_and_fraction_prefer_the_overlapped_pair():
    standalone = profile(link=40.0, cpu=100.0)
    assert standalone.backend == "hybrid" and standalone.fetch_fraction == pytest.approx(0.4)
    both = profile(link=40.0, cpu=100.0, link_overlap_gbs=30.0, cpu_overlap_gbs=50.0)
    assert both.backend == "offload" and both.qstar() is None  # 50 < 2 × 30
    hybrid = profile(link=40.0, cpu=100.0, link_overlap_gbs=30.0, cpu_overlap_gbs=90.0)
    assert hybrid.qstar().fraction == pytest.approx(0.25, abs=1e-4)
