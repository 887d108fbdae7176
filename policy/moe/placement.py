"""Which MoE layers run on the CPU (their experts are computed from host memory, never copied).

A user spec (``--moe-cpu-layers``) takes three forms:

- an explicit list of layer ids, ``"3,7,11"`` (a single id needs a trailing comma, ``"5,"``);
- a count, ``"8"``: that many layers spread evenly over the stack, ``{round(i·L/k) : i < k}``;
- a fraction of the layers, ``"0.5"``, rounded (half to even) to a count, then spread.

``"auto"`` derives the layers from the pin budget: when the experts' host banks do not fit
in the memory that may be pinned, the overflow's share of layers goes to the CPU, taken
from **both ends** of the stack (head-heavy on odd counts), because expert-cache miss rates
are U-shaped across depth. Everything here is pure.
"""

from __future__ import annotations

import math

from moetray.policy.refused import Refused

__all__ = ["PlacementRefused", "auto_cpu_layers", "parse_cpu_layers_spec", "spread_layers"]


class PlacementRefused(Refused, ValueError):
    """``kind``: ``invalid_geometry``, ``out_of_range`` (an explicit id), ``count_out_of_range``,
    ``fraction_out_of_range``, ``unparsable`` or ``auto_needs_sizes``."""


def spread_layers(count: int, num_layers: int) -> frozenset[int]:
    """``count`` layers spread evenly: ``{round(i · L / count) : i < count}`` (half to even)."""
    if count <= 0:
        return frozenset()
    return frozenset(round(i * num_layers / count) for i in range(count))


def auto_cpu_layers(num_layers: int, bank_bytes: int, pin_budget: int | None) -> frozenset[int]:
    """The layers to run on the CPU so the other layers' expert banks fit the pin budget.

    No layers when there is no cap (``pin_budget`` None) or the banks fit. Otherwise
    ``ceil((1 − budget / bank) · L)`` layers, taken alternately from the first and the last
    layers (the extra one from the head). Refuses ``invalid_geometry`` for negative sizes.
    """
    if num_layers < 0 or bank_bytes < 0 or (pin_budget is not None and pin_budget < 0):
        raise PlacementRefused("invalid_geometry", f"layers {num_layers}, bank {bank_bytes} B, "
                               f"budget {pin_budget} B must not be negative")
    if pin_budget is None or bank_bytes <= pin_budget or num_layers == 0:
        return frozenset()
    count = -(-(bank_bytes - pin_budget) * num_layers // bank_bytes)  # exact ceil
    head = (count + 1) // 2
    tail = count - head
    return frozenset(range(head)) | frozenset(range(num_layers - tail, num_layers))


def parse_cpu_layers_spec(spec: str | None, num_layers: int, *, bank_bytes: int | None = None,
                          pin_budget: int | None = None) -> frozenset[int]:
    """Parse a CPU-layer spec into layer ids. ``None`` and ``""`` mean no CPU layers.

    ``"auto"`` needs ``bank_bytes`` (all layers' host expert banks) and uses `auto_cpu_layers`.
    Refuses with `PlacementRefused` (see its kinds). Pure.
    """
    if not isinstance(num_layers, int) or num_layers < 0:
        raise PlacementRefused("invalid_geometry", f"num_layers {num_layers!r} must be ≥ 0")
    text = (spec or "").strip()
    if not text:
        return frozenset()
    if text.lower() == "auto":
        if bank_bytes is None:
            raise PlacementRefused("auto_needs_sizes", "'auto' needs the expert bank size and the pin budget")
        return auto_cpu_layers(num_layers, bank_bytes, pin_budget)
    if "," in text:
        ids = set()
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                layer = int(part)
            except ValueError:
                raise PlacementRefused("unparsable", f"{part!r} in {spec!r} is not a layer id",
                                       spec=spec) from None
            if not 0 <= layer < num_layers:
                raise PlacementRefused("out_of_range", f"layer {layer} not in [0, {num_layers})",
                                       layer=layer, num_layers=num_layers)
            ids.add(layer)
        return frozenset(ids)
    try:
        count = int(text)
    except ValueError:
        count = None
    if count is not None:
        if not 0 <= count <= num_layers:
            raise PlacementRefused("count_out_of_range", f"count {count} not in [0, {num_layers}]",
                                   count=count, num_layers=num_layers)
        return spread_layers(count, num_layers)
    try:
        fraction = float(text)
    except ValueError:
        raise PlacementRefused("unparsable", f"{spec!r} is not a list, a count, a fraction or 'auto'",
                               spec=spec) from None
    if not math.isfinite(fraction) or not 0.0 <= fraction <= 1.0:
        raise PlacementRefused("fraction_out_of_range", f"fraction {fraction} not in [0, 1]",
                               fraction=fraction)
    return spread_layers(round(fraction * num_layers), num_layers)
