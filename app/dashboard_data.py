"""What the dashboard plots, kept as plain Python: time series of snapshots and event markers.

The window feeds it every StatsSnapshot as it arrives; the dashboard's timer reads it.
"""
from __future__ import annotations

import bisect
import math
import time
from collections import deque
from dataclasses import dataclass

from engine.events import StatsSnapshot

from .messages import format_bytes

MAX_POINTS = 3000
MAX_MARKERS = 60


@dataclass(frozen=True, slots=True)
class Marker:
    time_s: float                       # seconds since the dashboard started
    kind: str                           # "mode", "evict", "reset", "load"
    label: str


HOLD_GAP_S = 0.25                       # longer silences are drawn as held values


class DashboardData:
    SERIES = ("kv", "weights", "budget", "rss", "torch", "gpu", "decode", "prefill", "tokens_held")

    def __init__(self, start_s: float | None = None):
        self.start_s = time.monotonic() if start_s is None else start_s
        self.times: deque[float] = deque(maxlen=MAX_POINTS)
        self.series: dict[str, deque[float]] = {name: deque(maxlen=MAX_POINTS) for name in self.SERIES}
        self.markers: deque[Marker] = deque(maxlen=MAX_MARKERS)
        self.latest: StatsSnapshot | None = None
        self.num_marks = 0              # markers ever added, so a full deque still shows change
        self.version = 0                # bumps on every change; the redraw timer skips when unchanged

    def elapsed(self, monotonic_s: float | None = None) -> float:
        return (time.monotonic() if monotonic_s is None else monotonic_s) - self.start_s

    def add(self, snapshot: StatsSnapshot) -> None:
        previous = self.latest
        if previous is not None and snapshot.time_s < previous.time_s:
            return                      # a late snapshot from before a newer one: keep the newest
        t = max(0.0, self.elapsed(snapshot.time_s))
        if previous is not None and snapshot.tokens_evicted > previous.tokens_evicted:
            evicted = snapshot.tokens_evicted - previous.tokens_evicted
            self.mark("evict", f"evicted {evicted:,} tok", t)
        if self.times and t - self.times[-1] > HOLD_GAP_S:
            # nothing was reported for a while: the previous values held until now, so the curves
            # step at this sample instead of sloping across the idle gap
            self.times.append(t)
            for series in self.series.values():
                series.append(series[-1])
        self.times.append(t)
        memory = snapshot.memory
        values = {"kv": snapshot.kv_bytes, "weights": snapshot.weight_bytes, "budget": snapshot.budget_bytes,
                  "rss": memory.rss_bytes,
                  "torch": memory.torch_allocated_bytes, "gpu": memory.gpu_used_bytes,
                  "decode": snapshot.decode_tok_s, "prefill": snapshot.prefill_tok_s,
                  "tokens_held": snapshot.tokens_held}
        for name, value in values.items():
            self.series[name].append(float(value))
        self.latest = snapshot
        self.version += 1

    def mark(self, kind: str, label: str, t: float | None = None) -> None:
        self.markers.append(Marker(self.elapsed() if t is None else t, kind, label))
        self.num_marks += 1
        self.version += 1

    def clear(self) -> None:
        self.times.clear()
        for values in self.series.values():
            values.clear()
        self.markers.clear()
        self.num_marks += 1
        self.latest = None
        self.version += 1

    def nearest_index(self, t: float) -> int | None:
        if not self.times:
            return None
        i = bisect.bisect_left(self.times, t)
        candidates = [j for j in (i - 1, i) if 0 <= j < len(self.times)]
        return min(candidates, key=lambda j: abs(self.times[j] - t))


def nice_ceiling(value: float) -> float:
    """The next 1-2-5 step at or above value, so axis ranges (and their cached pictures) change rarely."""
    if value <= 0:
        return 1.0
    decade = 10 ** math.floor(math.log10(value))
    return next(step * decade for step in (1, 2, 5, 10) if step * decade >= value)


def time_span_end(t: float) -> float:
    """Right edge of the time axes: the next whole 30 s (60 s past two minutes) beyond t."""
    step = 30.0 if t < 120 else 60.0
    return step * math.ceil((t + 1e-9) / step)


def layer_hover_text(snapshot: StatsSnapshot | None, layer_index: int) -> str | None:
    if snapshot is None or not 0 <= layer_index < len(snapshot.layers):
        return None
    layer = snapshot.layers[layer_index]
    share = snapshot.budget_bytes / len(snapshot.layers)
    total = layer.k_bytes + layer.v_bytes
    text = (f"layer {layer.layer}\nK {layer.k_format}: {layer.k_bytes:,} B ({format_bytes(layer.k_bytes)})\n"
            f"V {layer.v_format}: {layer.v_bytes:,} B ({format_bytes(layer.v_bytes)})\ntotal {total:,} B")
    return text + (f"\n{total / share:.3%} of its budget share ({format_bytes(share)})" if share else "")


def series_hover_text(data: DashboardData, kind: str, t: float) -> str | None:
    index = data.nearest_index(t)
    if index is None:
        return None
    values = {name: data.series[name][index] for name in data.SERIES}
    head = f"t = {data.times[index]:.1f} s"
    if kind == "speed":
        return f"{head}\ndecode {values['decode']:.1f} tok/s\nprefill {values['prefill']:.1f} tok/s"
    lines = [head, f"KV held {format_bytes(values['kv'])} ({int(values['kv']):,} B)",
             f"budget {format_bytes(values['budget'])}", f"weights {format_bytes(values['weights'])}",
             f"process RSS {format_bytes(values['rss'])}"]
    if values["torch"]:
        lines.append(f"torch allocator {format_bytes(values['torch'])}")
    if values["gpu"]:
        lines.append(f"GPU (NVML) {format_bytes(values['gpu'])}")
    lines.append(f"tokens held {int(values['tokens_held']):,}")
    return "\n".join(lines)
