"""The Qt binding the tray runs on must not corrupt Python's reference counts.

PySide6-Essentials 6.12.0 dropped one reference to ``True`` on every signal emission
carrying it (pyqtgraph emits such signals on every redraw), so the tray died with
"bool_dealloc" after a few minutes of 1 Hz updates. pyproject excludes that release;
this test fails on any binding with the same defect.
"""

from __future__ import annotations

import sys

from PySide6.QtCore import QObject, Signal


class _Emitter(QObject):
    flag = Signal(bool)
    value = Signal(object)


def test_emitting_true_keeps_its_reference_count():
    emitter = _Emitter()
    emitter.flag.connect(lambda v: None)
    emitter.value.connect(lambda v: None)
    before = sys.getrefcount(True)
    for _ in range(200):
        emitter.flag.emit(True)
        emitter.value.emit(True)
    assert sys.getrefcount(True) >= before - 5
