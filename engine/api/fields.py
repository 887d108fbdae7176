"""Request field types shared by the routes: numbers taken as OpenAI takes them, nothing coerced.

A whole integer field is ``Annotated[int, Strict(), Field(ge=…, le=…), WHOLE_NUMBER]``: an
integer, or a JSON number with no fractional part (``8.0`` is 8, as OpenAI accepts it); never a
boolean (``true`` is not 1) and never a string (``"8"`` is not 8). The bounds sit inside the type,
before ``WHOLE_NUMBER``, so the OpenAPI schema states them as ``minimum``/``maximum`` (placed after
the validator, pydantic still enforces them but the schema would say ``ge``/``le``). Each such
type is spelled as a module-level alias, not built by a call, so a type checker can read it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BeforeValidator


def _whole(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value  # bools, strings and fractions meet the strict int check and fail there


WHOLE_NUMBER = BeforeValidator(_whole)
"""Takes a whole JSON number as the int it spells; the last item of a whole integer's ``Annotated``."""
