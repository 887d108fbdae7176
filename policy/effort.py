"""Which reasoning-effort and thinking controls this checkpoint's chat template speaks.

Learned by rendering, never by reading the template source or the model's name: two
checkpoints with the same family name can differ (one grades effort, the other ignores
it), and a template that ignores a variable renders the same with or without it. The
engine hands in ``render(messages, **kwargs) -> str`` built from its tokenizer (raising
on a template error); tokenizer objects never enter this module.

Clients speak their provider's dialect (OpenAI's low/medium/high; others add minimal,
xhigh, max, none). ``quantize_effort`` maps a request onto what the template accepts, to
the nearest gear within a small distance, or drops it (the template default applies):
it never silently escalates, and ``max`` is reached only by its own name.

Thinking toggles are sent in every spelling at once (templates ignore variables they do
not read): ``THINKING_OFF``, ``THINKING_ON``, ``THINKING_ADAPTIVE``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from moetray.policy.refused import Refused

__all__ = [
    "EFFORT_SCALE",
    "GRADED_EFFORTS",
    "KNOWN_EFFORTS",
    "OPENAI_EFFORTS",
    "PROBE_MESSAGES",
    "PROBE_TOOL",
    "QUANTIZE_MAX_DISTANCE",
    "THINKING_ADAPTIVE",
    "THINKING_KEYS",
    "THINKING_OFF",
    "THINKING_ON",
    "Effort",
    "EffortProfile",
    "EffortRefused",
    "TemplateKwargs",
    "ThinkingProfile",
    "ThinkingState",
    "broadcast_effort_spellings",
    "effective_efforts",
    "explicit_thinking",
    "parse_effort",
    "probe_effort",
    "probe_thinking",
    "quantize_effort",
    "template_kwargs_for_request",
]

Render = Callable[..., str]


class Effort(StrEnum):
    """The reasoning-effort ladder shared with vLLM and SGLang, least effort first."""

    NONE = "none"
    MINIMAL = "minimal"
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"
    XHIGH = "xhigh"
    MAX = "max"


EFFORT_SCALE: dict[Effort, int] = {
    Effort.NONE: 0,
    Effort.MINIMAL: 100,
    Effort.LOW: 200,
    Effort.MEDIUM: 700,
    Effort.HIGH: 900,
    Effort.XHIGH: 990,
    Effort.MAX: 990,
}
"""Scale positions in thousandths (vLLM/SGLang's 0.0 … 0.99), integers so quantizing is exact."""
QUANTIZE_MAX_DISTANCE = 150
"""How far (in thousandths) a request may move to a supported gear: high→xhigh yes, medium→high no."""
KNOWN_EFFORTS: tuple[Effort, ...] = tuple(Effort)
OPENAI_EFFORTS: tuple[Effort, ...] = (Effort.LOW, Effort.MEDIUM, Effort.HIGH)
GRADED_EFFORTS: tuple[Effort, ...] = (Effort.LOW, Effort.MEDIUM, Effort.HIGH, Effort.XHIGH)

THINKING_OFF: dict[str, Any] = {"enable_thinking": False, "thinking": False, "thinking_mode": "disabled"}
"""Every spelling of "do not think" that real templates read."""
THINKING_ON: dict[str, Any] = {"enable_thinking": True, "thinking": True, "thinking_mode": "enabled"}
"""Every spelling of "think"."""
THINKING_ADAPTIVE: dict[str, Any] = {"thinking_mode": "adaptive"}
"""The model decides whether to think (templates with a third mode)."""
THINKING_KEYS = frozenset(THINKING_OFF) | frozenset(THINKING_ADAPTIVE)
"""Template kwargs that, set by a client, decide thinking on their own."""

PROBE_MESSAGES: tuple[dict[str, str], ...] = ({"role": "user", "content": "ping"},)
PROBE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "noop",
        "description": "Does nothing.",
        "parameters": {"type": "object", "properties": {}},
    },
}
_NONSENSE_EFFORT = "moetray-probe-effort"


def parse_effort(value: object) -> Effort | None:
    """The ladder gear a client's value names (case and surrounding spaces ignored); ``None`` otherwise.

    Unknown names, non-strings and empty strings give ``None``, never an error.
    """
    if not isinstance(value, str):
        return None
    try:
        return Effort(value.strip().lower())
    except ValueError:
        return None


@dataclass(frozen=True)
class EffortProfile:
    """What probing learned about a template's effort control.

    ``accepted``: gears that rendered without error. ``diverged``: gears whose render
    differed from the no-effort baseline in some round. ``default``: the highest gear
    (``max`` aside) that rendered exactly as the baseline in every round, i.e. the gear in
    force when the client sends nothing. ``consumes``: effort changes the prompt at all.
    ``validates``: some gear was rejected (the template enumerates its vocabulary).
    ``interpolates``: an arbitrary string renders without error and changes the prompt
    (printed, or clamped to some level): the template accepts anything, so its
    vocabulary is capped to a ladder. ``strength_dialect``: the
    template reads ``reasoning_strength`` rather than ``reasoning_effort``.
    """

    accepted: frozenset[Effort] = frozenset()
    diverged: frozenset[Effort] = frozenset()
    default: Effort | None = None
    consumes: bool = False
    validates: bool = False
    interpolates: bool = False
    strength_dialect: bool = False

    @classmethod
    def inert(cls) -> EffortProfile:
        """A template that does not consume effort (or could not be probed)."""
        return cls()

    @property
    def supported(self) -> tuple[Effort, ...]:
        """The vocabulary clients may use with this template (``effective_efforts``)."""
        return effective_efforts(self)


def _ordered(efforts: Iterable[Effort]) -> tuple[Effort, ...]:
    return tuple(e for e in KNOWN_EFFORTS if e in set(efforts))


def effective_efforts(profile: EffortProfile) -> tuple[Effort, ...]:
    """Decides the vocabulary a template supports, least effort first; pure.

    Nothing when the template does not consume effort. A validating template is
    authoritative: exactly the gears it accepted. A template that interpolates any string
    is capped to the OpenAI triple (the graded ladder for the strength dialect) plus its
    default. A selective template (it reacts to some names only) offers the gears that
    changed the prompt plus its default.
    """
    if not profile.consumes:
        return ()
    if profile.validates:
        return _ordered(profile.accepted)
    extra = {profile.default} if profile.default is not None else set()
    if profile.interpolates:
        ladder = GRADED_EFFORTS if profile.strength_dialect else OPENAI_EFFORTS
        return _ordered((set(ladder) & profile.accepted) | extra)
    return _ordered(set(profile.diverged) | extra)


def quantize_effort(requested: object, supported: Iterable[object]) -> Effort | None:
    """Decides which supported gear a client's effort becomes, or ``None`` (send nothing); pure.

    A supported value passes through. Otherwise the nearest supported gear on the scale,
    ``max`` excluded (reachable only by its own name), ties to the higher gear, accepted
    only within ``QUANTIZE_MAX_DISTANCE``. Unknown names, non-strings and an empty
    vocabulary give ``None``: the template's default applies, never an escalation.
    """
    effort = requested if isinstance(requested, Effort) else parse_effort(requested)
    if effort is None:
        return None
    vocabulary = {e for e in (parse_effort(s) if not isinstance(s, Effort) else s for s in supported) if e}
    if effort in vocabulary:
        return effort
    best: Effort | None = None
    best_distance: int | None = None
    for candidate in KNOWN_EFFORTS:  # ascending, so a later equal distance is the higher gear
        if candidate is Effort.MAX or candidate not in vocabulary:
            continue
        distance = abs(EFFORT_SCALE[candidate] - EFFORT_SCALE[effort])
        if best_distance is None or distance <= best_distance:
            best, best_distance = candidate, distance
    if best is None or best_distance is None or best_distance > QUANTIZE_MAX_DISTANCE:
        return None
    return best


def _try_render(render: Render, messages: Sequence[Mapping[str, str]],
                kwargs: Mapping[str, Any]) -> str | None:
    try:
        return render([dict(m) for m in messages], add_generation_prompt=True, **kwargs)
    except Exception:  # a template error means "rejected" here, whatever its type
        return None


def _spelled(value: str) -> dict[str, str]:
    return {"reasoning_effort": value, "reasoning_strength": value}


def probe_effort(render: Render, *, messages: Sequence[Mapping[str, str]] = PROBE_MESSAGES) -> EffortProfile:
    """Learns the template's effort vocabulary by differential rendering; calls ``render`` only.

    Three rounds: bare, with one no-op tool (some templates grade effort only when tools
    force thinking), and with ``THINKING_ON``. A round whose baseline (no effort) fails to
    render is skipped: the template rejects the probe's shape, not the effort. In each
    round every known gear is rendered in both spellings (``reasoning_effort`` and
    ``reasoning_strength``, as requests will send it): an error marks it rejected, a
    different prompt marks it diverged. A nonsense value tells a template that takes any
    string from one that reacts to a few names only. No round rendering → ``inert()``.
    ``render`` receives ``tools`` and ``add_generation_prompt`` as keywords.
    """
    rounds: list[dict[str, Any]] = [{}, {"tools": [PROBE_TOOL]}, dict(THINKING_ON)]
    ran = False
    rejected: set[Effort] = set()
    diverged: set[Effort] = set()
    equal_everywhere = set(KNOWN_EFFORTS)
    interpolates = False
    strength_dialect = False
    for extra in rounds:
        baseline = _try_render(render, messages, extra)
        if baseline is None:
            continue
        ran = True
        for effort in KNOWN_EFFORTS:
            text = _try_render(render, messages, {**extra, **_spelled(effort.value)})
            if text is None:
                rejected.add(effort)
                equal_everywhere.discard(effort)
                continue
            if text != baseline:
                diverged.add(effort)
                equal_everywhere.discard(effort)
        nonsense = _try_render(render, messages, {**extra, **_spelled(_NONSENSE_EFFORT)})
        if nonsense is not None and nonsense != baseline:
            interpolates = True
        strength = _try_render(render, messages, {**extra, "reasoning_strength": Effort.LOW.value})
        if strength is not None and strength != baseline:
            strength_dialect = True
    if not ran:
        return EffortProfile.inert()
    accepted = frozenset(set(KNOWN_EFFORTS) - rejected)
    consumes = bool(rejected or diverged)
    defaults = [e for e in KNOWN_EFFORTS if e in equal_everywhere and e in accepted and e is not Effort.MAX]
    return EffortProfile(
        accepted=accepted,
        diverged=frozenset(diverged),
        default=defaults[-1] if defaults and consumes else None,
        consumes=consumes,
        validates=bool(rejected),
        interpolates=interpolates,
        strength_dialect=strength_dialect,
    )


# --- thinking -------------------------------------------------------------------------------


class ThinkingState(StrEnum):
    OFF = "off"
    ON = "on"
    ADAPTIVE = "adaptive"


@dataclass(frozen=True)
class ThinkingProfile:
    """What probing learned about a template's thinking toggle.

    ``toggleable``: ``THINKING_OFF`` and ``THINKING_ON`` render differently. ``adaptive``:
    ``THINKING_ADAPTIVE`` renders a third, distinct prompt. ``default``: the state a bare
    request gets, ``None`` when the template has no toggle (nothing to default).
    """

    toggleable: bool = False
    adaptive: bool = False
    default: ThinkingState | None = None


def probe_thinking(render: Render, *,
                   messages: Sequence[Mapping[str, str]] = PROBE_MESSAGES) -> ThinkingProfile:
    """Learns whether thinking can be switched, and its default, by rendering; calls ``render`` only.

    Renders bare, ``THINKING_OFF`` and ``THINKING_ON``; any error → not toggleable. The
    default is ``OFF`` when bare equals off, ``ADAPTIVE`` when bare equals the adaptive
    render, else ``ON``.
    """
    bare = _try_render(render, messages, {})
    off = _try_render(render, messages, THINKING_OFF)
    on = _try_render(render, messages, THINKING_ON)
    if bare is None or off is None or on is None or off == on:
        return ThinkingProfile()
    adaptive_text = _try_render(render, messages, THINKING_ADAPTIVE)
    adaptive = adaptive_text is not None and adaptive_text not in (off, on)
    if bare == off:
        default = ThinkingState.OFF
    elif adaptive and bare == adaptive_text:
        default = ThinkingState.ADAPTIVE
    else:
        default = ThinkingState.ON
    return ThinkingProfile(toggleable=True, adaptive=adaptive, default=default)


def _truthy(value: object) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in ("", "false", "0", "no", "off", "disabled", "none")
    return bool(value)


def explicit_thinking(kwargs: Mapping[str, Any] | None) -> ThinkingState | None:
    """The thinking state a client's template kwargs ask for, or ``None`` when they do not say.

    ``thinking_mode`` wins when present ("adaptive", "disabled"/"off"/"chat" → off,
    anything else that is set → on); then ``enable_thinking``, then ``thinking``, read as
    booleans (a non-empty string or non-zero number is true). Pure.
    """
    if not kwargs:
        return None
    mode = kwargs.get("thinking_mode")
    if isinstance(mode, str) and mode.strip():
        mode = mode.strip().lower()
        if mode == "adaptive":
            return ThinkingState.ADAPTIVE
        return ThinkingState.OFF if mode in ("disabled", "off", "chat", "none") else ThinkingState.ON
    for key in ("enable_thinking", "thinking"):
        if key in kwargs and kwargs[key] is not None:
            return ThinkingState.ON if _truthy(kwargs[key]) else ThinkingState.OFF
    return None


def broadcast_effort_spellings(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``kwargs`` with ``reasoning_effort`` also sent as ``reasoning_strength``.

    Templates read one spelling or the other and ignore the rest. An explicit
    ``reasoning_strength`` wins. Does not mutate ``kwargs``.
    """
    out = dict(kwargs)
    if "reasoning_effort" in out and "reasoning_strength" not in out:
        out["reasoning_strength"] = out["reasoning_effort"]
    return out


class EffortRefused(Refused):
    """A request's effort is not a gear of any dialect we know; ``.kind`` is ``invalid_request_error``.

    ``.value`` is what the client sent. Refused before rendering, so the error reaches the
    client as a 400 before any stream starts.
    """

    KINDS = ("invalid_request_error",)

    def __init__(self, value: object) -> None:
        known = ", ".join(e.value for e in KNOWN_EFFORTS)
        message = f"unknown reasoning_effort {value!r}; expected one of: {known}"
        super().__init__("invalid_request_error", message, value=value)


@dataclass(frozen=True)
class TemplateKwargs:
    """What a request renders with: the kwargs, and the effort and thinking decided (for logs and replies)."""

    kwargs: dict[str, Any]
    effort: Effort | None
    thinking: ThinkingState | None


def template_kwargs_for_request(
    reasoning_effort: object,
    chat_template_kwargs: Mapping[str, Any] | None,
    effort: EffortProfile,
    thinking: ThinkingProfile,
) -> TemplateKwargs:
    """Decides the template kwargs for one request from its OpenAI fields; pure.

    ``reasoning_effort`` is the request's top-level field (``None``/empty: absent);
    ``chat_template_kwargs`` the client's own kwargs, kept (an explicit template key always
    wins). Thinking set explicitly in those kwargs decides on its own. Otherwise
    ``"none"``/``"off"`` switches a toggleable template off; any other effort switches it
    on. The effort is quantized to the template's vocabulary and sent in both spellings
    when it maps to a gear; dropped (template default) when it does not. Refuses a value
    no dialect knows with ``EffortRefused``.
    """
    kwargs: dict[str, Any] = dict(chat_template_kwargs or {})
    raw = reasoning_effort
    if isinstance(raw, str) and not raw.strip():
        raw = None
    requested: Effort | None = None
    wants_off = False
    if raw is not None:
        if isinstance(raw, str) and raw.strip().lower() == "off":
            wants_off = True
        else:
            requested = parse_effort(raw)
            if requested is None:
                raise EffortRefused(raw)
            wants_off = requested is Effort.NONE
    client_thinking = explicit_thinking(kwargs)
    decided_thinking = client_thinking
    if client_thinking is None and thinking.toggleable and raw is not None:
        if wants_off:
            kwargs.update(THINKING_OFF)
            decided_thinking = ThinkingState.OFF
        else:
            kwargs.update(THINKING_ON)
            decided_thinking = ThinkingState.ON
    if decided_thinking is None and thinking.toggleable:
        decided_thinking = thinking.default
    mapped: Effort | None = None
    if "reasoning_effort" not in kwargs and "reasoning_strength" not in kwargs and requested is not None:
        mapped = quantize_effort(requested, effective_efforts(effort))
        if mapped is not None:
            kwargs["reasoning_effort"] = mapped.value
    elif "reasoning_effort" in kwargs or "reasoning_strength" in kwargs:
        mapped = parse_effort(kwargs.get("reasoning_effort", kwargs.get("reasoning_strength")))
    return TemplateKwargs(broadcast_effort_spellings(kwargs), mapped, decided_thinking)
