"""How numbers read on the dashboard and in the tray: unknown is "—", never 0.

Every formatter takes ``None`` for "unknown" and returns :data:`DASH` for it, so a value
the engine could not measure can never be drawn as a zero.
"""

from __future__ import annotations

DASH = "—"
GIB = 1024**3
MIB = 1024**2


def fmt_bytes(value: int | float | None) -> str:
    """``1.50 GiB`` / ``12.0 MiB`` / ``512 B``; ``None`` → "—"."""
    if value is None:
        return DASH
    value = float(value)
    if abs(value) >= GIB:
        return f"{value / GIB:.2f} GiB"
    if abs(value) >= MIB:
        return f"{value / MIB:.1f} MiB"
    if abs(value) >= 1024:
        return f"{value / 1024:.1f} KiB"
    return f"{value:.0f} B"


def fmt_int(value: int | None) -> str:
    """Thousands separated with a thin space; ``None`` → "—"."""
    return DASH if value is None else f"{value:,}".replace(",", "\u2009")


def fmt_rate(value: float | None, unit: str = "tok/s") -> str:
    if value is None:
        return DASH
    return f"{value:.1f} {unit}" if value < 100 else f"{value:.0f} {unit}"


def fmt_ms(value: float | None) -> str:
    if value is None:
        return DASH
    return f"{value:.0f} ms" if value >= 10 else f"{value:.1f} ms"


def fmt_pct(value: float | None) -> str:
    """A fraction in [0, 1] as a percentage; ``None`` → "—"."""
    return DASH if value is None else f"{100.0 * value:.0f} %"


def fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return DASH
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def fmt_duration_ms(ms: float | None) -> str:
    """``159 ms`` below a second, ``2.1 s`` above, ``2 min 05 s`` past a minute; ``None`` → "—"."""
    if ms is None:
        return DASH
    if ms < 1000:
        return f"{ms:.0f} ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f} s"
    return fmt_age(ms / 1000)
