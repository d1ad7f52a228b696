"""Garbage collection on the GUI thread only.

Python's cyclic collector runs in whichever thread allocates when a threshold is crossed. When that is the
engine's worker thread (a model loading, a reply decoding) and the garbage holds Qt objects made on the GUI
thread, their destructors run on the worker: they take Qt's connection locks and then wait for the GIL, which
the GUI thread holds while it deletes their neighbours, waiting for those locks. The app freezes (the test suite
caught it: a menu deleted on the GUI thread against a QObject collected on the load thread). So the desktop app
turns automatic collection off and collects on a GUI-thread timer, with Python's own thresholds (pyqtgraph
ships the same idea as GarbageCollector).
"""
from __future__ import annotations

import gc

from PySide6.QtCore import QObject, QTimer


class GuiThreadCollector(QObject):
    """Owns collection while it lives: automatic collection off, the objects alive at its start frozen (never
    scanned), a timer on this (the GUI) thread collecting the generations whose counts passed their thresholds.
    stop() unfreezes and gives collection back to Python. Where its caller has frozen objects already (the test
    suite freezes its imports once), it leaves them frozen, before and after: Python unfreezes all or nothing."""

    def __init__(self, parent: QObject | None = None, interval_ms: int = 1000):
        super().__init__(parent)
        self._was_enabled = gc.isenabled()
        self._threshold = gc.get_threshold()
        gc.disable()
        self._froze = gc.get_freeze_count() == 0
        if self._froze:
            gc.freeze()           # what exists now (the imported modules: torch, Qt) is never scanned again,
                                  # so a full collection on the GUI thread stays short
        self._timer = QTimer(self)
        self._timer.timeout.connect(self.check)
        self._timer.start(interval_ms)

    def check(self) -> int:
        """Collect what Python would have collected by now; returns the objects found unreachable."""
        (c0, c1, c2), (t0, t1, t2) = gc.get_count(), self._threshold
        if c0 <= t0:
            return 0
        generation = 2 if c1 > t1 and c2 > t2 else 1 if c1 > t1 else 0
        return gc.collect(generation)

    def stop(self) -> None:
        self._timer.stop()
        if self._froze:
            gc.unfreeze()
        if self._was_enabled:
            gc.enable()
