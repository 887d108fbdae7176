"""The tests' two example tools, as function objects and as OpenAI tool objects.

Small bounds (short strings, one-digit days) keep the arguments a grammar forces on a
random-weight model short; ``SCHEMAS`` is what a forced call's arguments must validate against.
"""

from __future__ import annotations

WEATHER_FUNCTION = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 6},
            "days": {"type": "integer", "minimum": 1, "maximum": 9},
            "unit": {"enum": ["c", "f"]},
            "hourly": {"type": "boolean"},
        },
        "required": ["city", "days"],
    },
}
TIME_FUNCTION = {
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string", "maxLength": 5}},
        "required": ["zone"],
    },
}
WEATHER = {"type": "function", "function": WEATHER_FUNCTION}
TIME = {"type": "function", "function": TIME_FUNCTION}
SCHEMAS = {f["name"]: f["parameters"] for f in (WEATHER_FUNCTION, TIME_FUNCTION)}
