"""Where misses are computed and how host banks are held: the policy calls made at load time.

- :func:`resolve_qstar`: the q* split (``policy.moe.qstar``) from an explicit fetch fraction,
  or from this device's measured bandwidth profile (``policy.moe.bench_profile``), which
  ``moetray bench bw`` writes; no usable profile means the offload backend (every miss fetched).
- :func:`resolve_cpu_layers`: which MoE layers the CPU computes (``policy.moe.placement``).
- :func:`settle_host_banks`: what memory class each layer's host bank ends in
  (``policy.moe.residency``): pinned after filling for layers copied to a CUDA device,
  mlock-ed for CPU layers, pageable otherwise, with sticky downgrades.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch

from moetray.policy.moe.bench_profile import DeviceIdentity, ProfileLookup, load_profile
from moetray.policy.moe.placement import parse_cpu_layers_spec
from moetray.policy.moe.qstar import QStarPolicy
from moetray.policy.moe.residency import HostResidency, ResidencyPlan, pin_budget, requested_labels

__all__ = [
    "CACHE_DIR_ENV",
    "cache_directory",
    "device_identity",
    "lookup_profile",
    "resolve_cpu_layers",
    "resolve_qstar",
    "settle_host_banks",
]

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "MOETRAY_CACHE_DIR"
"""Overrides the folder that holds this machine's bandwidth profiles (``<dir>/benchbw/``)."""


def cache_directory() -> Path:
    """``$MOETRAY_CACHE_DIR``, else the user's cache folder for moetray."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("moetray"))


def device_identity(device: torch.device) -> DeviceIdentity:
    """What a bandwidth profile is keyed on: the GPU (name + UUID) or this CPU's model name."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        return DeviceIdentity("cuda", props.name, str(uuid) if uuid else None)
    return DeviceIdentity("cpu", _cpu_name())


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def lookup_profile(device: torch.device, directory: Path | None = None) -> ProfileLookup:
    """This device's profile lookup (``ok`` / ``missing`` / ``corrupt`` / ``foreign``)."""
    return load_profile(directory or cache_directory(), device_identity(device))


def resolve_qstar(fetch_fraction: float | None, *, device: torch.device,
                  directory: Path | None = None,
                  expert_bytes: tuple[int, int] | None = None) -> QStarPolicy | None:
    """The q* policy: explicit ``fetch_fraction`` → hybrid with that fraction; None → the
    profile's verdict (hybrid only where the CPU beats the link by the threshold); no usable
    profile → None (offload). ``expert_bytes`` = ``(stored, decoded)`` bytes per expert: what a
    fetch moves and what the CPU reads (they differ for a quantized store). Refuses
    (``QStarRefused``) a non-finite fraction."""
    if fetch_fraction is not None:
        return QStarPolicy.from_fraction(fetch_fraction)
    lookup = lookup_profile(device, directory)
    if lookup.status != "ok" or lookup.profile is None:
        if lookup.status != "missing":
            log.warning("bandwidth profile %s not used (%s): %s", lookup.path, lookup.status, lookup.reason)
        return None
    if expert_bytes is None:
        return lookup.profile.qstar()
    return lookup.profile.qstar(link_bytes=expert_bytes[0], cpu_bytes=expert_bytes[1])


def resolve_cpu_layers(spec: str | None, num_layers: int, *, bank_bytes: int | None = None,
                       total_ram_bytes: int | None = None) -> frozenset[int]:
    """Parse ``--moe-cpu-layers`` (list, count, fraction or ``auto`` from the pin budget)."""
    budget = None
    if spec is not None and spec.strip().lower() == "auto":
        budget = pin_budget(total_ram_bytes or _total_ram(), wsl=_is_wsl())
    return parse_cpu_layers_spec(spec, num_layers, bank_bytes=bank_bytes, pin_budget=budget)


def _total_ram() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


def _is_wsl() -> bool:
    try:
        return "microsoft" in Path("/proc/version").read_text().lower()
    except OSError:
        return False


def settle_host_banks(banks: list[torch.Tensor], cpu_layers: frozenset[int], device: torch.device, *,
                      pin: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                      lock: Callable[[torch.Tensor], bool] | None = None) -> ResidencyPlan:
    """Give each filled host bank its memory class, as ``ResidencyPlan.settle_action`` says.

    Mutates ``banks`` in place (a pinned bank replaces its pageable original). ``pin``
    returns a page-locked, device-registered copy of a bank, or None on failure: pin after
    fill, one layer at a time, so the transient extra host memory is one layer's bank.
    ``lock`` mlocks a bank and returns False on failure. A failed pin or lock leaves the bank
    pageable, and one failed lock stops further lock attempts (sticky). On the CPU device
    tier there is no device to register with, so "pin" leaves the bank pageable: the slot
    copy is a plain memcpy that needs no device address. On CUDA the plan's
    ``check_attach`` then refuses a copied layer that did not end pinned
    (``ResidencyRefused``). Returns the plan (labels per layer).
    """
    plan = ResidencyPlan(requested_labels(len(banks), cpu_layers))
    pin = pin or _pinned_copy
    lock = lock or _mlock
    for layer, bank in enumerate(banks):
        action = plan.settle_action(layer)
        if action == "pin" and device.type == "cuda":
            pinned = pin(bank)
            if pinned is not None:
                banks[layer] = pinned
            plan.record(layer, HostResidency.PINNED if pinned is not None else HostResidency.PAGEABLE)
        elif action == "lock":
            ok = lock(bank)
            plan.record_lock(ok)
            plan.record(layer, HostResidency.LOCKED if ok else HostResidency.PAGEABLE)
        else:
            plan.record(layer, HostResidency.PAGEABLE)
    if device.type == "cuda":
        plan.check_attach(cpu_layers)
    return plan


def _pinned_copy(bank: torch.Tensor) -> torch.Tensor | None:
    try:
        return bank.pin_memory()
    except RuntimeError as exc:  # pragma: no cover - CUDA only
        log.warning("pinning a %d-byte expert bank failed: %s", bank.numel() * bank.element_size(), exc)
        return None


_libc = None


def _mlock(bank: torch.Tensor) -> bool:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    size = bank.numel() * bank.element_size()
    return _libc.mlock(ctypes.c_void_p(bank.data_ptr()), ctypes.c_size_t(size)) == 0
