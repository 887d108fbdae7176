"""Request field types shared by the routes: numbers taken as OpenAI takes them, nothing coerced.

``whole_int(ge, le)``: an integer, or a JSON number with no fractional part (``8.0`` is 8, as
OpenAI accepts it); never a boolean (``true`` is not 1) and never a string (``"8"`` is not 8).
The bounds sit inside the type so the OpenAPI schema states them as ``minimum``/``maximum``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, Strict


def _whole(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value  # bools, strings and fractions meet the strict int check and fail there


def whole_int(ge: int | None = None, le: int | None = None) -> Any:
    """The ``WholeInt`` type with optional inclusive bounds."""
    return Annotated[int, Strict(), Field(ge=ge, le=le), BeforeValidator(_whole)]
