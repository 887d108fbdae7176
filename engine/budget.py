"""Measured numbers for the start-up split, and the context ceiling every request is held to.

``DeviceBudget`` is the memory the two pools (expert slots and KV pages) may spend, measured
once per process: on CUDA from the free device memory before the model loaded and after
its weights landed (``pool_budget.budget_from_free_memory``); on a machine without a GPU the
"device" tier is host RAM and the budget is the user's ``--budget-bytes`` or, by default, a
stated fraction of RAM — labelled as such, never presented as VRAM.

``ContextCeiling`` decides how long a request may be: prompt plus ``max_tokens`` must fit the
model's trained context and the KV pool (a request longer than the pool could never be
scheduled). The refusal wording is verbatim what agent harnesses match on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetray.policy.refused import Refused

DEFAULT_CPU_BUDGET_FRACTION = 0.10
"""Share of host RAM the pools may use on a machine without a GPU, unless ``--budget-bytes``."""
MAX_TOKENS_CEILING = 1 << 20
"""No request may ask for more new tokens than this, whatever the context (absurd values are 400)."""


@dataclass(frozen=True)
class DeviceBudget:
    kind: str  # "cuda" | "cpu"
    name: str
    label: str
    total_bytes: int | None
    budget_bytes: int
    source: str  # how budget_bytes was obtained, for the log and the UI


def host_ram_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # pragma: no cover - psutil is a dependency
        return None


def cpu_name() -> str:
    import platform

    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_budget(budget_bytes: int | None, fraction: float = DEFAULT_CPU_BUDGET_FRACTION) -> DeviceBudget:
    """The CPU device tier's budget: the user's figure, else ``fraction`` of host RAM."""
    total = host_ram_bytes()
    if budget_bytes is not None:
        source = "user-set --budget-bytes"
        budget = int(budget_bytes)
    else:
        if total is None:
            raise RuntimeError("cannot read host RAM size; pass --budget-bytes")
        budget = int(total * fraction)
        source = f"default: {fraction:.0%} of host RAM"
    return DeviceBudget(
        kind="cpu",
        name=cpu_name(),
        label=f"CPU device tier: host RAM budget ({source})",
        total_bytes=total,
        budget_bytes=budget,
        source=source,
    )


def cuda_free_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) device memory right now, as the driver reports it."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def cuda_budget(
    device: torch.device,
    *,
    baseline_free: int,
    free_after_weights: int,
    pools_already_allocated: int,
    budget_bytes: int | None,
    ratio: float,
) -> DeviceBudget:
    """The CUDA budget: measured headroom minus the weights, plus pools the load already allocated.

    ``pools_already_allocated`` adds back what the loader spent on the expert slot pool
    (it is part of the budget being planned, not of the fixed weights).
    """
    from moetray.policy.pool_budget import budget_from_free_memory

    _, total = torch.cuda.mem_get_info(device)
    if budget_bytes is not None:
        budget, source = int(budget_bytes), "user-set --budget-bytes"
    else:
        budget = (
            budget_from_free_memory(
                baseline_free_bytes=baseline_free, free_after_weights_bytes=free_after_weights, ratio=ratio
            )
            + pools_already_allocated
        )
        source = f"measured: {ratio:.0%} of free device memory before load, minus the weights"
    return DeviceBudget(
        kind="cuda",
        name=torch.cuda.get_device_name(device),
        label="GPU memory",
        total_bytes=int(total),
        budget_bytes=budget,
        source=source,
    )


class ContextTooLong(Refused):
    """A prompt (or prompt + max_tokens) that cannot fit; ``.kind`` is ``context_length_exceeded``."""

    KINDS = ("context_length_exceeded",)

    def __init__(self, message: str, *, prompt_tokens: int, limit: int) -> None:
        super().__init__("context_length_exceeded", message, prompt_tokens=prompt_tokens, limit=limit)


@dataclass(frozen=True)
class ContextCeiling:
    """How many positions a request may use: ``min(trained context, KV pool tokens)``."""

    limit: int

    @classmethod
    def for_model(cls, trained_context: int | None, kv_tokens: int) -> ContextCeiling:
        limit = kv_tokens if trained_context is None else min(trained_context, kv_tokens)
        return cls(limit=max(limit, 1))

    def fit(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """Decides the granted ``max_tokens``: clamps to what is left after the prompt.

        Mutates nothing. Refuses with ``ContextTooLong`` when the prompt alone reaches the
        limit ("prompt is too long: N tokens > M maximum", verbatim). ``None`` asks for
        everything left.
        """
        if prompt_tokens >= self.limit:
            raise ContextTooLong(
                f"prompt is too long: {prompt_tokens} tokens > {self.limit - 1} maximum",
                prompt_tokens=prompt_tokens,
                limit=self.limit,
            )
        room = self.limit - prompt_tokens
        return room if max_tokens is None else min(max_tokens, room)
