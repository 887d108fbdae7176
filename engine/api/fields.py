"""Request field types shared by the routes: numbers taken as OpenAI takes them, nothing coerced.

``WholeInt``: an integer, or a JSON number with no fractional part (``8.0`` is 8, as OpenAI
accepts it); never a boolean (``true`` is not 1) and never a string (``"8"`` is not 8).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Strict


def _whole(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value  # bools, strings and fractions meet the strict int check and fail there


WholeInt = Annotated[int, Strict(), BeforeValidator(_whole)]
