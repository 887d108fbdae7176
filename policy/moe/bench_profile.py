"""This machine's measured bandwidth profile: where it lives, and when it may be trusted.

`moetray bench bw` measures the host→device link (a memcpy on a CPU-only machine) and the
CPU's expert-compute bandwidth, and saves a `BandwidthProfile` with `save_profile`. The
engine reads it back with `load_profile` to pick the backend (``offload`` or ``hybrid``)
and the q* fetch fraction.

Rules:

- one file per device, ``<directory>/benchbw/<device key>.json``: a link's bandwidth
  belongs to one card in one slot, not to the box; the key is the GPU's UUID when known;
- a profile recorded for another device is never borrowed (``foreign``), nor is one that
  cannot be read or parsed (``corrupt``): the lookup stops there and returns no profile,
  rather than trying other files;
- writes are atomic (a temporary file in the same folder, flushed, then renamed), so a
  crash mid-write leaves the old profile or none, never half a file.

The caller names the directory (the engine passes its cache folder); this module only uses
``os`` inside it.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from typing import Any, Literal, cast

from moetray.policy.moe.qstar import Backend, QStarPolicy, fetch_fraction, recommend_backend
from moetray.policy.refused import Refused

__all__ = [
    "PROFILE_VERSION",
    "BandwidthProfile",
    "DeviceIdentity",
    "ProfileLookup",
    "ProfileRefused",
    "load_profile",
    "profile_path",
    "save_profile",
]

PROFILE_VERSION = 1
LookupStatus = Literal["ok", "missing", "corrupt", "foreign"]


class ProfileRefused(Refused, ValueError):
    """``kind``: ``not_positive`` (a bandwidth ≤ 0, NaN or infinite), ``only_one_side``
    (one overlapped figure without the other), ``invalid_device`` or ``corrupt``."""


@dataclass(frozen=True)
class DeviceIdentity:
    """What a profile was measured on: ``kind`` ("cuda" or "cpu"), the device ``name`` and,
    for a GPU, its ``uuid`` (which tells two identical cards apart)."""

    kind: str
    name: str
    uuid: str | None = None

    def __post_init__(self) -> None:
        if not self.kind or not self.name:
            raise ProfileRefused("invalid_device", f"device needs a kind and a name, got "
                                 f"{self.kind!r}/{self.name!r}", kind_=self.kind, name=self.name)

    @property
    def key(self) -> str:
        """File-name-safe identity: the UUID when known, else kind and name."""
        raw = self.uuid if self.uuid else f"{self.kind}-{self.name}"
        return re.sub(r"[^a-z0-9._-]+", "-", raw.lower()).strip("-.") or self.kind


@dataclass(frozen=True)
class BandwidthProfile:
    """Measured bandwidths in GB/s. ``link_gbs``: host→device copies (pinned on CUDA; a
    memcpy on the CPU device tier). ``cpu_gbs``: the CPU's batch-1 expert compute, in bytes
    of weights read per second. The ``*_overlap_gbs`` pair, when present, was measured with
    both paths running at once and is preferred."""

    device: DeviceIdentity
    link_gbs: float
    cpu_gbs: float
    link_overlap_gbs: float | None = None
    cpu_overlap_gbs: float | None = None
    threshold: float = 2.0
    expert_bytes: int | None = None
    measured_unix: int | None = None
    link_label: str = ""
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        for name in ("link_gbs", "cpu_gbs", "threshold"):
            if not _positive(getattr(self, name)):
                raise ProfileRefused("not_positive", f"{name} = {getattr(self, name)!r} must be a "
                                     f"positive finite number", field=name)
        pair = (self.link_overlap_gbs, self.cpu_overlap_gbs)
        if (pair[0] is None) != (pair[1] is None):
            raise ProfileRefused("only_one_side", "overlapped bandwidths come in pairs, got "
                                 f"link {pair[0]!r} and cpu {pair[1]!r}")
        for name, value in zip(("link_overlap_gbs", "cpu_overlap_gbs"), pair, strict=True):
            if value is not None and not _positive(value):
                raise ProfileRefused("not_positive", f"{name} = {value!r} must be a positive "
                                     f"finite number", field=name)

    @property
    def overlapped(self) -> bool:
        return self.link_overlap_gbs is not None

    @property
    def backend(self) -> Backend:
        """``"hybrid"`` only when the CPU beats the link by ``threshold`` (overlapped figures
        preferred), else ``"offload"``."""
        return self.backend_for()

    def backend_for(self, link_bytes: int | None = None, cpu_bytes: int | None = None) -> Backend:
        """:attr:`backend` for experts that move ``link_bytes`` over the link and make the CPU read
        ``cpu_bytes`` (a quantized store: the link moves the stored blocks, the CPU reads them
        decoded). The comparison is in experts per second: the link's bandwidth counts
        ``cpu_bytes / link_bytes`` times over. Both None: equal sizes. Pure."""
        link, cpu = self._rates()
        return recommend_backend(cpu, _scaled(link, link_bytes, cpu_bytes), self.threshold)

    @property
    def fetch_fraction(self) -> float | None:
        return self.fetch_fraction_for()

    def fetch_fraction_for(self, link_bytes: int | None = None, cpu_bytes: int | None = None) -> float | None:
        """:attr:`fetch_fraction` for experts of those stored and decoded sizes (see
        :meth:`backend_for`). Pure."""
        link, cpu = self._rates()
        return fetch_fraction(_scaled(link, link_bytes, cpu_bytes), cpu, overlapped=self.overlapped)

    def _rates(self) -> tuple[float, float]:
        if self.overlapped:
            assert self.link_overlap_gbs is not None and self.cpu_overlap_gbs is not None
            return self.link_overlap_gbs, self.cpu_overlap_gbs
        return self.link_gbs, self.cpu_gbs

    def qstar(self, link_bytes: int | None = None, cpu_bytes: int | None = None) -> QStarPolicy | None:
        """The q* policy for the hybrid backend, or None when every miss should be fetched;
        ``link_bytes`` / ``cpu_bytes`` as in :meth:`backend_for`."""
        if self.backend_for(link_bytes, cpu_bytes) != "hybrid":
            return None
        fraction = self.fetch_fraction_for(link_bytes, cpu_bytes)
        return QStarPolicy.from_fraction(fraction) if fraction is not None else QStarPolicy.fixed_cap(1)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> BandwidthProfile:
        """Parse a saved profile; refuses ``corrupt`` for anything else (wrong version,
        missing or mistyped fields, impossible numbers)."""
        try:
            if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
                raise ValueError(f"version {data.get('version') if isinstance(data, dict) else None!r}")
            fields = dict(data)
            device = fields.pop("device")
            if not isinstance(device, dict):
                raise ValueError("device is not an object")
            # Unchecked until built (the identity refuses an empty one): the check below refuses non-text.
            dev = DeviceIdentity(kind=cast(str, device.get("kind")), name=cast(str, device.get("name")),
                                 uuid=device.get("uuid"))
            for key in ("kind", "name"):
                if not isinstance(getattr(dev, key), str):
                    raise ValueError(f"device {key} is not text")
            known = {f for f in cls.__dataclass_fields__ if f != "device"}
            if set(fields) - known:
                raise ValueError(f"unknown fields {sorted(set(fields) - known)}")
            return cls(device=dev, **fields)
        except ProfileRefused as exc:
            raise ProfileRefused("corrupt", f"profile is not usable: {exc}") from exc
        except (TypeError, ValueError, KeyError) as exc:
            raise ProfileRefused("corrupt", f"profile is not usable: {exc}") from exc


@dataclass(frozen=True)
class ProfileLookup:
    """``profile`` is set only when ``status == "ok"``; ``path`` is the one file consulted."""

    status: LookupStatus
    path: str
    profile: BandwidthProfile | None = None
    reason: str = ""


def profile_path(directory: str | os.PathLike[str], device: DeviceIdentity) -> str:
    """Where ``device``'s profile lives under ``directory``. Pure."""
    return os.path.join(os.fspath(directory), "benchbw", f"{device.key}.json")


def load_profile(directory: str | os.PathLike[str], device: DeviceIdentity, *,
                 explicit_path: str | os.PathLike[str] | None = None) -> ProfileLookup:
    """Find the profile measured on ``device``. An ``explicit_path`` is the only candidate.

    ``missing``: no file. ``corrupt``: unreadable or unparsable. ``foreign``: recorded for
    another device (key, name or kind differ). Only ``ok`` carries a profile: a corrupt or
    foreign file is never borrowed and no other file is tried. Reads one file; mutates nothing.
    """
    path = os.fspath(explicit_path) if explicit_path is not None else profile_path(directory, device)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        return ProfileLookup("missing", path, reason="no profile measured on this device")
    except (OSError, UnicodeDecodeError) as exc:
        return ProfileLookup("corrupt", path, reason=f"unreadable: {exc}")
    try:
        profile = BandwidthProfile.from_json(json.loads(text))
    except (ValueError, ProfileRefused) as exc:
        return ProfileLookup("corrupt", path, reason=str(exc))
    theirs = profile.device
    if (theirs.key != device.key or theirs.name != device.name or theirs.kind != device.kind):
        return ProfileLookup("foreign", path, reason=f"measured on {theirs.kind} {theirs.name!r} "
                             f"({theirs.key}), this is {device.kind} {device.name!r} ({device.key})")
    return ProfileLookup("ok", path, profile=profile)


def save_profile(directory: str | os.PathLike[str], profile: BandwidthProfile) -> str:
    """Write ``profile`` to its device's path atomically (temp file, fsync, rename); returns
    the path. Creates the folder. On any failure the previous file is left as it was."""
    path = profile_path(directory, profile.device)
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".benchbw.", suffix=".partial")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(profile.to_json(), fh, indent=1, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def _scaled(link_gbs: float, link_bytes: int | None, cpu_bytes: int | None) -> float:
    """The link's bandwidth in the CPU's bytes: ``link × cpu_bytes / link_bytes`` (as is when
    either size is unknown or not positive)."""
    if not (_positive(link_bytes) and _positive(cpu_bytes)):
        return link_gbs
    assert link_bytes is not None and cpu_bytes is not None
    return link_gbs * cpu_bytes / link_bytes


def _positive(value: object) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)
