"""What the dashboard plots, kept as plain Python: time series of snapshots and event markers.

The window feeds it every StatsSnapshot as it arrives; the dashboard's timer reads it.
"""
from __future__ import annotations

import bisect
import math
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable

from PySide6.QtCore import QCoreApplication

from kvchat.engine.events import LayerBytes, StatsSnapshot
from kvchat.engine.plan.estimate import window_counts
from kvchat.engine.units import DTYPE_BYTES, MIB

from kvchat.app.dashboard.bar_widgets import format_mib
from kvchat.app.i18n import value_name
from kvchat.app.bridge.messages import format_bytes

MAX_POINTS = 3000
LINEAR_ATTENTION = "linear_attention"   # LayerBytes.kind of a layer that keeps a recurrent state, not K and V
MAX_MARKERS = 60


@dataclass(frozen=True, slots=True)
class Marker:
    time_s: float                       # seconds since the dashboard started
    kind: str                           # "mode", "evict", "reset", "load", "restore", "offload"
    label: str
    count: int = 1                      # evictions this marker stands for (a running eviction marker)
    tokens: int = 0                     # tokens those evictions took out of the window


def eviction_label(tokens: int, count: int) -> str:
    if count == 1:
        return QCoreApplication.translate("DashboardData", "evicted {n} tok").format(n=f"{tokens:,}")
    return QCoreApplication.translate("DashboardData", "evicted {n} tok in {k} steps").format(
        n=f"{tokens:,}", k=f"{count:,}")


def switch_notice(cache: str, before: StatsSnapshot, after: StatsSnapshot) -> str:
    """A live switch in numbers: KV memory before and after, the tokens held, and the chat's tokens the cache no
    longer holds (they left a window, now or earlier: a full cache does not bring them back, a reset reads them)."""
    fields = dict(cache=cache, before=format_mib(before.kv_bytes), after=format_mib(after.kv_bytes),
                  tokens=f"{after.tokens_held:,}", held=f"{before.tokens_held:,}", lost=f"{after.tokens_evicted:,}")
    if after.tokens_evicted:
        return QCoreApplication.translate(
            "DashboardData", "Switched the cache to {cache}: KV memory {before} → {after}, holding {tokens} tokens "
            "(before: {held}). {lost} tokens of this chat are no longer in the cache: they left the window and the "
            "model does not see them; Reset reads the whole chat again.").format(**fields)
    if after.tokens_held != before.tokens_held:
        return QCoreApplication.translate(
            "DashboardData", "Switched the cache to {cache}: KV memory {before} → {after}, holding {tokens} tokens "
            "(before: {held}): the whole chat.").format(**fields)
    return QCoreApplication.translate(
        "DashboardData", "Switched the cache to {cache}: KV memory {before} → {after} for the same {tokens} "
        "tokens.").format(**fields)


HOLD_GAP_S = 0.25                       # longer silences are drawn as held values (rates: as a gap)
RATE_SERIES = ("decode", "prefill")     # only meaningful while a reply is being generated


@dataclass(frozen=True, slots=True)
class TokenRoom:
    """How many more tokens the conversation can take, and what stops it first."""

    held: int                           # tokens whose K/V the cache holds
    left: int | None                    # None: a sliding window keeps the cache bounded
    binding: str                        # "budget", "context" or "window"
    context_limit: int                  # the model's context in tokens; 0 when unknown
    fraction: float                     # 0.0-1.0 of whichever limit binds (window: of the budget's blocks)


def token_room(snapshot: StatsSnapshot) -> TokenRoom:
    """Tokens left = the smaller of what the KV budget and the model's context allow."""
    held, limit = snapshot.tokens_held, snapshot.context_tokens
    if snapshot.tokens_left is None:    # a window bounds the cache (or a remote server does not say)
        fraction = snapshot.blocks_used / snapshot.blocks_budget if snapshot.blocks_budget else 0.0
        return TokenRoom(held, None, "window", limit, min(1.0, fraction))
    budget_left = snapshot.tokens_left
    if limit and limit - snapshot.tokens_in_context <= budget_left:
        left = max(0, limit - snapshot.tokens_in_context)
        return TokenRoom(held, left, "context", limit, min(1.0, snapshot.tokens_in_context / limit))
    total = held + budget_left
    return TokenRoom(held, budget_left, "budget", limit, held / total if total else 0.0)


def is_state_layer(layer: LayerBytes) -> bool:
    """A linear-attention layer: a recurrent state of fixed size instead of K and V, which no cache mode touches."""
    return layer.kind == LINEAR_ATTENTION


def is_shared_layer(layer: LayerBytes) -> bool:
    """A layer that attends over an earlier layer's K and V and holds none of its own (Gemma 4's last layers)."""
    return layer.kv_source is not None


def attention_layers(snapshot: StatsSnapshot) -> tuple[LayerBytes, ...]:
    """The layers that hold K and V of their own: not a linear-attention layer (Qwen3.5 has three in four), nor one
    that reads another layer's (Gemma 4's last layers)."""
    return tuple(layer for layer in snapshot.layers if not is_state_layer(layer) and not is_shared_layer(layer))


def state_layers(snapshot: StatsSnapshot) -> tuple[LayerBytes, ...]:
    return tuple(layer for layer in snapshot.layers if is_state_layer(layer))


def shared_layers(snapshot: StatsSnapshot) -> tuple[LayerBytes, ...]:
    return tuple(layer for layer in snapshot.layers if is_shared_layer(layer))


def state_held_bytes(snapshot: StatsSnapshot) -> int:
    """What the recurrent state takes from the KV budget: the live state and each snapshot kept of it."""
    return snapshot.state_bytes * (1 + len(snapshot.snapshots))


def layer_budget_share(snapshot: StatsSnapshot) -> float:
    """One attention layer's share of the KV budget: what the state and its snapshots leave, over the layers that
    hold K and V of their own (the state layers' bytes do not grow and a sharing layer holds none: no share)."""
    kv_layers = len(attention_layers(snapshot))
    return max(0, snapshot.budget_bytes - state_held_bytes(snapshot)) / kv_layers if kv_layers else 0.0


def full_precision_bytes_per_token(snapshot: StatsSnapshot) -> float:
    """KV bytes a token takes at the model dtype over all attention layers; 0.0 when the snapshot cannot say.

    The engine thread fills the snapshot field from the model; without it, layers that are held in
    a full-precision format still tell their own size per token (a linear-attention layer's state takes none, nor
    does a layer that reads another layer's K and V)."""
    if snapshot.full_precision_bytes_per_token > 0:
        return snapshot.full_precision_bytes_per_token
    kv_layers = attention_layers(snapshot)
    full = [layer for layer in kv_layers if layer.k_format in DTYPE_BYTES and layer.k_format == layer.v_format]
    if not full or not snapshot.tokens_held:
        return 0.0
    per_layer = sum(layer.k_bytes + layer.v_bytes for layer in full) / len(full) / snapshot.tokens_held
    return per_layer * len(kv_layers)


def full_precision_layer_bytes(snapshot: StatsSnapshot) -> float:
    """What one attention layer would hold at the model dtype for the blocks it holds now: a part-filled block takes
    all its bytes, at full precision as in the layer's bar."""
    kv_layers = len(attention_layers(snapshot))
    if not kv_layers:
        return 0.0
    bs = snapshot.block_size
    # a hybrid model's blocks_used counts every group's blocks: its global layers hold tokens_held in whole blocks
    tokens = -(-snapshot.tokens_held // bs) * bs if is_hybrid(snapshot) else \
        max(snapshot.tokens_held, snapshot.blocks_used * bs)
    return full_precision_bytes_per_token(snapshot) * tokens / kv_layers


def byte_unit(max_bytes: float) -> tuple[str, float]:
    return ("MiB", MIB) if max_bytes >= MIB else ("KiB", 1024.0)


def stable_top(current: float, needed: float) -> float:
    """A y-axis top in bytes that only grows: `current` while `needed` fits under it, else the next
    1-2-5 step above `needed` (in KiB or MiB), so a mode switch never rescales the bars."""
    if needed <= current:
        return current
    unit, scale = byte_unit(needed)
    return nice_ceiling(needed / scale) * scale


class DashboardData:
    SERIES = ("kv", "weights", "budget", "rss", "torch", "gpu", "decode", "prefill", "tokens_held")

    def __init__(self, start_s: float | None = None):
        self.start_s = time.monotonic() if start_s is None else start_s
        self.times: deque[float] = deque(maxlen=MAX_POINTS)
        self.series: dict[str, deque[float]] = {name: deque(maxlen=MAX_POINTS) for name in self.SERIES}
        self.markers: deque[Marker] = deque(maxlen=MAX_MARKERS)
        self.latest: StatsSnapshot | None = None
        self.layer_top_bytes = 0.0      # the per-layer plot's y top: grows with the chat, never with a mode switch
        self.num_marks = 0              # markers ever added, so a full deque still shows change
        self.version = 0                # bumps on every change; the redraw timer skips when unchanged
        self.generating = False         # a reply is running: the latest rates are live, else the last reply's

    def elapsed(self, monotonic_s: float | None = None) -> float:
        return (time.monotonic() if monotonic_s is None else monotonic_s) - self.start_s

    def add(self, snapshot: StatsSnapshot, generating: bool = True) -> None:
        """Record a snapshot; `generating` False means no reply is running, so rates are not plotted."""
        previous = self.latest
        if previous is not None and snapshot.time_s < previous.time_s:
            return                      # a late snapshot from before a newer one: keep the newest
        t = max(0.0, self.elapsed(snapshot.time_s))
        if previous is not None and snapshot.tokens_evicted > previous.tokens_evicted:
            self._mark_eviction(snapshot.tokens_evicted - previous.tokens_evicted, t)
        if self.times and t - self.times[-1] > HOLD_GAP_S:
            # nothing was reported for a while: the previous values held until now, so the curves
            # step at this sample instead of sloping across the idle gap
            self.times.append(t)
            for name, series in self.series.items():
                series.append(math.nan if name in RATE_SERIES else series[-1])
        self.times.append(t)
        memory = snapshot.memory
        values = {"kv": snapshot.kv_bytes, "weights": snapshot.weight_bytes, "budget": snapshot.budget_bytes,
                  "rss": memory.rss_bytes,
                  "torch": memory.torch_allocated_bytes, "gpu": memory.gpu_used_bytes,
                  # a reply's first snapshot has no rate yet: a gap, not a plunge to 0 tok/s
                  "decode": snapshot.decode_tok_s if generating and snapshot.decode_tok_s > 0 else math.nan,
                  "prefill": snapshot.prefill_tok_s if generating else math.nan,
                  "tokens_held": snapshot.tokens_held}
        for name, value in values.items():
            self.series[name].append(float(value))
        if snapshot.layers:
            self.layer_top_bytes = stable_top(self.layer_top_bytes, layer_peak_bytes(snapshot) * 1.05)
        self.latest = snapshot
        self.generating = generating
        self.version += 1

    def idle(self) -> None:
        """The reply ended: its last snapshot's rates are the last reply's from now on, not live ones."""
        self.generating = False
        self.version += 1

    def reset_scales(self) -> None:
        """A reset or another conversation: the per-layer scale starts again from what is held."""
        self.layer_top_bytes = 0.0
        if self.latest is not None and self.latest.layers:
            self.layer_top_bytes = stable_top(0.0, layer_peak_bytes(self.latest) * 1.05)
        self.version += 1

    def mark(self, kind: str, label: str, t: float | None = None) -> None:
        self.markers.append(Marker(self.elapsed() if t is None else t, kind, label))
        self.num_marks += 1
        self.version += 1

    def _mark_eviction(self, tokens: int, t: float) -> None:
        """A window evicts on every block it fills: consecutive evictions are one running marker, so they never
        push load, mode or reset markers out of the bounded list."""
        last = self.markers[-1] if self.markers else None
        if last is None or last.kind != "evict":
            self.mark("evict", eviction_label(tokens, 1), t)
            self.markers[-1] = replace(self.markers[-1], tokens=tokens)
            return
        count, tokens = last.count + 1, last.tokens + tokens
        self.markers[-1] = replace(last, label=eviction_label(tokens, count), count=count, tokens=tokens)
        self.num_marks += 1             # redrawn: the label changed in place
        self.version += 1

    def clear(self) -> None:
        self.times.clear()
        for values in self.series.values():
            values.clear()
        self.markers.clear()
        self.num_marks += 1
        self.latest = None
        self.layer_top_bytes = 0.0
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


def layer_peak_bytes(snapshot: StatsSnapshot) -> float:
    """The per-layer plot's highest value: the biggest bar (a state layer's included), its full-precision outline, or
    the line where a sliding layer's window is full (drawn before the chat reaches it)."""
    caps = [layer.window_bytes for layer in attention_layers(snapshot) if layer.window_bytes is not None]
    return max(max(layer.k_bytes + layer.v_bytes + layer.state_bytes for layer in snapshot.layers),
               full_precision_layer_bytes(snapshot), *caps)


def is_hybrid(snapshot: StatsSnapshot | None) -> bool:
    """Whether the attention layers keep different tokens (a Gemma's sliding and global layers): the plot marks which
    is which. A linear-attention layer keeps no tokens, so a window over Qwen3.5's attention layers is not hybrid."""
    return snapshot is not None and len({layer.window for layer in attention_layers(snapshot)}) > 1


def layer_kinds(snapshot: StatsSnapshot) -> tuple[tuple[int | None, int], ...]:
    """(window, layers) per distinct window of the attention layers, sliding ones first, then the global ones (None)."""
    return window_counts(layer.window for layer in attention_layers(snapshot))


def layer_hover_text(snapshot: StatsSnapshot | None, layer_index: int) -> str | None:
    if snapshot is None or not 0 <= layer_index < len(snapshot.layers):
        return None
    layer = snapshot.layers[layer_index]
    if is_state_layer(layer):
        return state_hover_text(layer)
    if is_shared_layer(layer):
        return shared_hover_text(layer, is_hybrid(snapshot))
    share = layer_budget_share(snapshot)
    total = layer.k_bytes + layer.v_bytes
    text = (QCoreApplication.translate("DashboardData", "layer {n}").format(n=layer.layer)
            + f"\nK {value_name(layer.k_format)}: {layer.k_bytes:,} B ({format_bytes(layer.k_bytes)})\n"
            f"V {value_name(layer.v_format)}: {layer.v_bytes:,} B ({format_bytes(layer.v_bytes)})\n"
            + QCoreApplication.translate("DashboardData", "total {n} B").format(n=f"{total:,}"))
    if is_hybrid(snapshot):
        text += "\n" + (QCoreApplication.translate("DashboardData", "global: holds every token") if layer.window is None
                        else QCoreApplication.translate("DashboardData", "sliding: keeps the newest {window} tokens, at "
                                                        "most {size}").format(window=f"{layer.window:,}",
                                                                              size=format_bytes(layer.window_bytes or 0)))
    full = full_precision_layer_bytes(snapshot)
    if full and total:
        text += "\n" + QCoreApplication.translate("DashboardData", "full precision would hold {size} ({share} of "
                                                   "it)").format(size=format_bytes(full), share=f"{total / full:.0%}")
    return text + ("\n" + QCoreApplication.translate("DashboardData", "{share} of its budget share ({size})").format(
        share=f"{total / share:.3%}", size=format_bytes(share)) if share else "")


def state_hover_text(layer: LayerBytes) -> str:
    return QCoreApplication.translate(
        "DashboardData", "layer {n}: linear attention\nkeeps a recurrent state of {bytes} B ({size}), the same at any "
        "length\nno K or V: cache modes (formats, window) do not apply to it; the state stays fp32").format(
        n=layer.layer, bytes=f"{layer.state_bytes:,}", size=format_bytes(layer.state_bytes))


def shared_hover_text(layer: LayerBytes, hybrid: bool) -> str:
    text = QCoreApplication.translate(
        "DashboardData", "layer {n} reads layer {source}'s K and V: it holds no bytes of its own\nK {k}, V {v}: "
        "counted in layer {source}'s bar").format(n=layer.layer, source=layer.kv_source,
                                                  k=value_name(layer.k_format), v=value_name(layer.v_format))
    if hybrid:
        text += "\n" + (QCoreApplication.translate("DashboardData", "global: attends over every token")
                        if layer.window is None else
                        QCoreApplication.translate("DashboardData", "sliding: attends over the newest {window} "
                                                   "tokens").format(window=f"{layer.window:,}"))
    return text


def series_hover_text(data: DashboardData, kind: str, t: float) -> str | None:
    index = data.nearest_index(t)
    if index is None:
        return None
    values = {name: data.series[name][index] for name in data.SERIES}
    head = f"t = {data.times[index]:.1f} s"
    if kind == "speed":
        if math.isnan(values["decode"]):
            return head + "\n" + QCoreApplication.translate("DashboardData", "idle: no reply was being generated")
        return head + "\n" + QCoreApplication.translate("DashboardData", "decode {decode} tok/s\nprefill {prefill} "
                                                         "tok/s").format(decode=f"{values['decode']:.1f}",
                                                                         prefill=f"{values['prefill']:.1f}")
    lines = [head, QCoreApplication.translate("DashboardData", "KV held {size} ({n} B)").format(
                 size=format_bytes(values['kv']), n=f"{int(values['kv']):,}"),
             QCoreApplication.translate("DashboardData", "budget {size}").format(size=format_bytes(values['budget'])),
             QCoreApplication.translate("DashboardData", "weights {size}").format(size=format_bytes(values['weights'])),
             QCoreApplication.translate("DashboardData", "process RSS {size}").format(size=format_bytes(values['rss']))]
    if values["torch"]:
        lines.append(QCoreApplication.translate("DashboardData", "torch allocator {size}").format(
            size=format_bytes(values['torch'])))
    if values["gpu"]:
        lines.append(f"GPU (NVML) {format_bytes(values['gpu'])}")
    lines.append(QCoreApplication.translate("DashboardData", "tokens held {n}").format(
        n=f"{int(values['tokens_held']):,}"))
    return "\n".join(lines)


MARKER_GLYPHS = {"mode": "◆", "evict": "▼", "reset": "↺", "load": "●", "restore": "⤒", "offload": "⤓"}


@dataclass(frozen=True, slots=True)
class MarkerCluster:
    """Markers close enough in time that their labels would touch: drawn as one marker with a count."""

    markers: tuple[Marker, ...]

    @property
    def time_s(self) -> float:
        return self.markers[0].time_s

    @property
    def kind(self) -> str:
        kinds = {marker.kind for marker in self.markers}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    @property
    def count(self) -> int:
        """Events drawn here: a running eviction marker counts each of its evictions."""
        return sum(marker.count for marker in self.markers)

    def label(self) -> str:
        if self.count == 1:             # short: the tooltip has the whole label
            marker = self.markers[0]
            short = {"load": QCoreApplication.translate("DashboardData", "load"),
                     "reset": QCoreApplication.translate("DashboardData", "reset")}.get(marker.kind, marker.label)
            return f"{MARKER_GLYPHS.get(marker.kind, '●')} {short}"
        if self.kind == "evict":
            return "▼ " + QCoreApplication.translate("DashboardData", "{n}× evicted").format(n=self.count)
        return "● " + QCoreApplication.translate("DashboardData", "{n} events").format(n=self.count)

    def tooltip(self) -> str:
        return "\n".join(f"{marker.time_s:6.1f} s  {marker.label}" for marker in self.markers)


def cluster_markers(markers, x_of: Callable[[float], float], width_of: Callable[[str], float],
                    right_px: float, gap_px: float = 6.0) -> list[tuple[MarkerCluster, float, float]]:
    """Group markers so that no two labels overlap: (cluster, left px, right px) in time order.

    x_of maps seconds to pixels, width_of a label to its width in pixels; a label that would run past
    right_px ends there instead. Neighbours whose labels would touch merge, until none do."""
    def place(cluster: MarkerCluster) -> tuple[MarkerCluster, float, float]:
        width = width_of(cluster.label())
        left = min(x_of(cluster.time_s), right_px - width)
        return cluster, left, left + width

    placed = [place(MarkerCluster((marker,))) for marker in sorted(markers, key=lambda m: m.time_s)]
    merged = True
    while merged:
        merged = False
        for i in range(len(placed) - 1):
            if placed[i + 1][1] < placed[i][2] + gap_px:
                both = MarkerCluster(placed[i][0].markers + placed[i + 1][0].markers)
                placed[i:i + 2] = [place(both)]
                merged = True
                break
    return placed
