"""A guard against PySide6 wheels that drop references to None, True and False (import it first).

The PySide6 6.12 wheels installed here return None, True and False from Qt calls
without taking a reference (the code assumes CPython 3.12's immortal
singletons). On CPython 3.11 every such call lowers the singleton's reference
count by one: `QPainter.drawLine`, `QWidget.setEnabled`, `Signal.emit`, ...
A live chart makes thousands of these calls a second, so the count reaches 0
within seconds and CPython aborts ("Fatal Python error: none_dealloc").

`ensure()` measures the leak; when there is one, it lifts the three
singletons' reference counts by 2**40, which makes them immortal in effect, as
they are on 3.12. Nothing else is touched, and on a sound PySide6 or on
CPython >= 3.12 it does nothing.
"""

from __future__ import annotations

import ctypes
import sys

from PySide6.QtCore import QObject

LIFT = 1 << 40
_PROBES = 16
_done = False
leaks: dict[str, int] = {}


def _leak_per_call(obj, call) -> int:
    before = sys.getrefcount(obj)
    for _ in range(_PROBES):
        call()
    return max(0, round((before - sys.getrefcount(obj)) / _PROBES))


def ensure() -> dict[str, int]:
    """Measure the leak once; lift None/True/False if Qt calls drop their references."""
    global _done
    if _done:
        return leaks
    _done = True
    if sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        return leaks
    probe = QObject()
    leaks["None"] = _leak_per_call(None, lambda: probe.setObjectName("probe"))
    leaks["False"] = _leak_per_call(False, lambda: probe.blockSignals(False))
    if any(leaks.values()):
        for obj in (None, True, False):
            ctypes.c_ssize_t.from_address(id(obj)).value += LIFT  # ob_refcnt is a PyObject's first field
    return leaks


ensure()
