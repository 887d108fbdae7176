"""Every refusal kind the control-plane, effort and turn policies can raise is mapped in wire.REFUSALS.

An unmapped kind reaches clients as a generic 500 that never retries: a transient "busy"
would look like a crash. Each refusal class lists its kinds in a ``KINDS`` tuple, so a
kind added without a row in ``wire.REFUSALS`` turns this test red.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from moetray.policy import effort, footprint, maintenance, outbox, pool_sizes, rebuild, turn
from moetray.policy.rebuild import OUTCOME_REFUSAL_KINDS, Applied, Latched, RejectedIntact, RolledBack
from moetray.policy.wire import REFUSALS

CONTROL_PLANE = (maintenance, rebuild, pool_sizes, outbox, footprint, effort, turn)


def exception_classes(module) -> list[type[BaseException]]:
    return [
        obj
        for _, obj in inspect.getmembers(module, inspect.isclass)
        if issubclass(obj, BaseException) and obj.__module__ == module.__name__
    ]


@pytest.mark.parametrize("module", CONTROL_PLANE, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_refusal_class_declares_its_kinds(module):
    """A refusal class without KINDS could raise a kind no table knows about, unnoticed."""
    for cls in exception_classes(module):
        assert isinstance(getattr(cls, "KINDS", None), tuple) and cls.KINDS, cls.__name__
        for kind in cls.KINDS:
            assert kind.isidentifier() and kind == kind.lower(), (cls.__name__, kind)


def test_every_declared_kind_is_mapped():
    """Issue 2: the HTTP layer maps kinds to statuses; an unmapped kind becomes a 500 that never retries."""
    declared = {
        (cls.__qualname__, kind)
        for module in CONTROL_PLANE
        for cls in exception_classes(module)
        for kind in cls.KINDS
    }
    assert declared  # the enumeration itself must find something
    assert {kind for _, kind in declared} >= {"busy", "too_large", "not_persisted", "loading"}
    unmapped = sorted(item for item in declared if item[1] not in REFUSALS)
    assert unmapped == []


def test_admission_kinds_cover_every_closed_gate_state():
    """Every closed state refuses by its own name; a stopping engine's is never retried (issue 11)."""
    closed = set(maintenance.GateState) - {maintenance.GateState.SERVING}
    assert set(maintenance.ADMISSION_KINDS) == closed
    assert set(maintenance.AdmissionClosed.KINDS) == set(maintenance.ADMISSION_KINDS.values())
    assert REFUSALS[maintenance.ADMISSION_KINDS[maintenance.GateState.STOPPING]].retry.value == "never"


def test_every_failed_rebuild_outcome_is_mapped():
    """The rebuild reply's status comes from the outcome; an unmapped outcome would hide a rollback."""
    outcome_kinds = {cls.refusal_kind for cls in (RejectedIntact, RolledBack, Latched)}
    assert outcome_kinds == set(OUTCOME_REFUSAL_KINDS)
    assert all(kind in REFUSALS for kind in outcome_kinds)
    assert Applied.refusal_kind is None


SOURCE_ROOMS = ("policy", "engine", "app", "ui")


def _kind_setters(tree: ast.Module) -> list[str]:
    """Classes in ``tree`` that set ``kind`` themselves: a class attribute or ``self.kind = …``."""
    found = []
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        for node in ast.walk(cls):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                own = isinstance(target, ast.Name) and target.id == "kind" and node in cls.body
                on_self = (isinstance(target, ast.Attribute) and target.attr == "kind"
                           and isinstance(target.value, ast.Name) and target.value.id == "self")
                if own or on_self:
                    found.append(f"{cls.name}:{node.lineno}")
    return found


def test_every_refusal_class_takes_its_kind_from_refused():
    """Issue 16: one shape for every refusal: ``Refused`` sets ``kind`` (and checks it against
    ``KINDS``); a class that sets its own skips that check and the shared ``fields``."""
    repo = Path(__file__).resolve().parents[2]
    offenders = []
    for room in SOURCE_ROOMS:
        for path in sorted((repo / room).rglob("*.py")):
            if path == repo / "policy" / "refused.py":
                continue
            setters = _kind_setters(ast.parse(path.read_text(encoding="utf-8")))
            offenders += [f"{path.relative_to(repo)}:{where}" for where in setters]
    assert offenders == []
