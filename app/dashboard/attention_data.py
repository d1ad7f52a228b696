"""The Attention page's numbers: colours for an AttentionMap (engine/runtime/attention_map.py), where its marks go
(message boundaries, sinks, the window's edge), and what hovering a cell says. No widgets here.

Mass spans orders of magnitude (a sink takes half a head's attention, a block in the middle of a long chat a
thousandth of a percent), so the colour follows log10(mass) over DECADES decades below the map's largest cell.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PySide6.QtCore import QCoreApplication

from kvchat.engine.runtime.attention_map import AttentionMap

DECADES = 4
# the scale, light to dark: little mass to much
STOPS = ((0.0, (255, 247, 214)), (0.3, (253, 186, 116)), (0.6, (234, 88, 12)), (0.8, (190, 18, 60)),
         (1.0, (59, 7, 100)))
ZERO_RGB = (255, 255, 255)              # held, and no mass measured there
LEFT_RGB = (148, 163, 184)              # the layer no longer holds the block: not "no mass", nothing to attend
LINEAR_RGB = (226, 232, 240)            # a linear-attention layer: it attends to no cached block
DISK_RGB = (125, 211, 252)              # retrieval past the budget: the block is on disk, not read back for this row
MAX_DRAWN_COLUMNS = 1024                # columns past this are pooled for drawing (the largest mass kept)


def lut(size: int = 256) -> np.ndarray:
    """[size, 3] uint8: the scale's colours from the least to the most mass."""
    at = np.linspace(0.0, 1.0, size)
    xs = [s[0] for s in STOPS]
    return np.stack([np.interp(at, xs, [s[1][k] for s in STOPS]) for k in range(3)], axis=1).round().astype(np.uint8)


LUT = lut()


@dataclass(frozen=True, slots=True)
class Scale:
    """log10 mass from `low` to `high` (decades) onto the scale's colours."""

    low: int
    high: int

    def position(self, mass: np.ndarray) -> np.ndarray:
        """mass -> 0.0-1.0 along the scale (below low: 0; above high: 1)."""
        with np.errstate(divide="ignore"):
            logs = np.log10(np.maximum(mass, 1e-30))
        return np.clip((logs - self.low) / (self.high - self.low), 0.0, 1.0)

    def ticks(self) -> list[tuple[float, str]]:
        """(position, label) at each decade: 0.01%, 0.1%, 1%, 10%, 100%."""
        return [((d - self.low) / (self.high - self.low), percent(10.0 ** d)) for d in range(self.low, self.high + 1)]


def scale_for(m: AttentionMap) -> Scale:
    """The decade above the map's largest cell, and DECADES below it."""
    attending = m.mass[m.attends] if m.attends.any() else m.mass[:0]
    top = float(attending.max()) if attending.size else 0.0
    high = min(0, math.ceil(math.log10(top))) if top > 0 else 0
    return Scale(high - DECADES, high)


def percent(mass: float) -> str:
    """A share as a percentage with about three figures: 42.1%, 0.0312%; "<0.001%" for specks, 0% for none."""
    if mass <= 0:
        return "0%"
    if mass < 1e-5:
        return "<0.001%"
    return f"{100 * mass:.3g}%"


def colours(mass: np.ndarray, held: np.ndarray, attends: np.ndarray, scale: Scale,
            on_disk: np.ndarray | None = None) -> np.ndarray:
    """[rows, columns] mass, held and [rows] attends -> [rows, columns, 4] RGBA bytes: the scale where held, white for
    no mass, LEFT_RGB where the row no longer holds the column (DISK_RGB where its block is on disk, [columns]
    on_disk), LINEAR_RGB for a row that attends to nothing. A block read back from disk is held: the scale."""
    index = (scale.position(mass) * (len(LUT) - 1)).round().astype(np.intp)
    rgb = LUT[index]
    rgb = np.where((mass <= 0)[..., None], np.array(ZERO_RGB, np.uint8), rgb)
    rgb = np.where((~held)[..., None], np.array(LEFT_RGB, np.uint8), rgb)
    if on_disk is not None:
        rgb = np.where((~held & on_disk[None, :])[..., None], np.array(DISK_RGB, np.uint8), rgb)
    rgb = np.where((~attends)[:, None, None], np.array(LINEAR_RGB, np.uint8), rgb)
    alpha = np.full(mass.shape + (1,), 255, np.uint8)
    return np.concatenate([rgb, alpha], axis=-1)


def pooled(mass: np.ndarray, held: np.ndarray, max_columns: int = MAX_DRAWN_COLUMNS) -> tuple[np.ndarray, np.ndarray,
                                                                                                int]:
    """[rows, columns] -> at most max_columns columns for drawing: each drawn column is a run of `per` columns, its
    largest mass (a hot block stays visible) and held where any of the run is. Returns (mass, held, per)."""
    columns = mass.shape[-1]
    per = max(1, -(-columns // max_columns))
    if per == 1:
        return mass, held, 1
    starts = np.arange(0, columns, per)
    return np.maximum.reduceat(mass, starts, axis=-1), np.logical_or.reduceat(held, starts, axis=-1), per


def pooled_flags(flags: np.ndarray | None, per: int) -> np.ndarray | None:
    """[columns] flags pooled as pooled() pools held: a drawn column is flagged where any of its run is."""
    if flags is None or per == 1:
        return flags
    return np.logical_or.reduceat(flags, np.arange(0, flags.shape[-1], per))


# --- where things are along the columns ---

def known_starts(m: AttentionMap) -> list[tuple[int, int]]:
    """(message index, first token) of each message whose start is known."""
    return [(i, s) for i, s in enumerate(m.message_starts) if s is not None and s < len(m.tokens)]


def boundary_columns(m: AttentionMap) -> list[float]:
    """The column where each known message after the first begins (a line at its left edge)."""
    return [float(column_x(m, s)) for i, s in known_starts(m)[1:]]


def column_x(m: AttentionMap, position: int) -> float:
    """Token `position` along the column axis: its column plus how far into it."""
    c = max(0, m.column_of(position))
    start, end = int(m.block_positions[c]), m.column_end(c)
    return c + (position - start) / max(1, end - start)


def sinks_x(m: AttentionMap) -> float | None:
    """Where the sinks end (None: no window, or no sinks)."""
    if m.window is None or m.sinks <= 0 or not m.tokens:
        return None
    return column_x(m, min(m.sinks, len(m.tokens) - 1)) if m.sinks < len(m.tokens) else float(m.num_columns)


def window_x(m: AttentionMap) -> float | None:
    """The window's left edge: the oldest token it holds (None: no window, or it has not slid)."""
    if m.window is None or len(m.tokens) <= m.window + m.sinks:
        return None
    return column_x(m, len(m.tokens) - m.window)


def token_ticks(m: AttentionMap, count: int = 5) -> list[tuple[float, str]]:
    """Token positions along the column axis at a 1-2-5 step, about `count` of them: "0", "500", "1k", "1.5k"."""
    from kvchat.app.dashboard.dashboard_data import nice_ceiling
    n = len(m.tokens)
    step = max(1, int(nice_ceiling(n / count)))
    return [(column_x(m, t), f"{t / 1000:g}k" if t >= 1000 else str(t)) for t in range(0, n, step)]


def message_at(m: AttentionMap, position: int) -> int | None:
    """The message holding token `position` (None: before the first known start: the system prompt)."""
    found = None
    for i, start in known_starts(m):
        if start > position:
            break
        found = i
    return found


def column_message(m: AttentionMap, column: int) -> int | None:
    return message_at(m, int(m.block_positions[column])) if 0 <= column < m.num_columns else None


# --- words ---

def summary_text(m: AttentionMap) -> str:
    translate = QCoreApplication.translate
    over = translate("AttentionData", "newest token") if m.over == "newest" else \
        translate("AttentionData", "mean over the last reply's {rows} tokens").format(rows=f"{m.rows:,}")
    per = (int(m.block_positions[1] - m.block_positions[0]) if m.num_columns > 1 else m.block_size)
    text = translate("AttentionData", "{over} · {layers} layers × {heads} heads · {tokens} tokens in {columns} "
                     "columns of {per}").format(over=over, layers=m.num_layers, heads=m.num_heads,
                                        tokens=f"{len(m.tokens):,}", columns=f"{m.num_columns:,}", per=per)
    linear = int((~m.attends).sum())
    if linear:
        text += translate("AttentionData", " · {n} linear-attention layers").format(n=linear)
    if m.window is not None:
        text += translate("AttentionData", " · window {window} + {sinks} sinks").format(
            window=f"{m.window:,}", sinks=m.sinks)
    sink = float(m.sink_mass[m.attends].mean()) if m.attends.any() else 0.0
    if sink > 0:
        text += translate("AttentionData", " · learned sink {share}").format(share=percent(sink))
    return text


def cell_text(m: AttentionMap, texts: tuple[str, ...], roles: tuple[str, ...], layer: int, column: int,
              head: int | None = None) -> str | None:
    """The cell under the pointer in words: which layer (and head), which message and words, and its share of the
    attention. None off the map."""
    translate = QCoreApplication.translate
    if not (0 <= layer < m.num_layers and 0 <= column < m.num_columns) or \
            (head is not None and not 0 <= head < m.num_heads):
        return None
    who = translate("AttentionData", "layer {layer}").format(layer=layer) if head is None else \
        translate("AttentionData", "layer {layer} · head {head}").format(layer=layer, head=head)
    start, end = int(m.block_positions[column]), m.column_end(column)
    lines = [who]
    index = message_at(m, start)
    role = roles[index] if index is not None and index < len(roles) else ""
    where = translate("AttentionData", "before the first message (system prompt)") if index is None else \
        translate("AttentionData", "message {n} ({role})").format(n=index + 1, role=role_name(role))
    lines.append(translate("AttentionData", "{where} · tokens {first}–{last}").format(
        where=where, first=f"{start:,}", last=f"{end - 1:,}"))
    words = texts[column] if column < len(texts) else ""
    if words:
        lines.append(f"«{words}»")
    if not m.attends[layer]:
        lines.append(translate("AttentionData", "linear attention: this layer keeps a state, it attends to no block"))
    elif not m.held[layer, column] and m.kept_by == "importance":
        lines.append(translate("AttentionData", "dropped by this layer's group: it drew the least attention"))
    elif not m.held[layer, column] and m.on_disk is not None and m.on_disk[column]:
        lines.append(translate("AttentionData", "on disk past the budget: this layer did not fetch it for the "
                                                "newest token"))
    elif not m.held[layer, column] and m.kept_by == "retrieval":
        lines.append(translate("AttentionData", "kept, but this layer did not read it for the newest token"))
    elif not m.held[layer, column]:
        lines.append(translate("AttentionData", "no longer held by this layer (outside its window)"))
    else:
        mass = float(m.mass[layer, :, column].mean() if head is None else m.mass[layer, head, column])
        lines.append(translate("AttentionData", "{share} of the attention").format(share=percent(mass)))
        if m.on_disk is not None and m.on_disk[column]:
            lines.append(translate("AttentionData", "on disk past the budget, fetched back for the newest token"))
    if m.window is not None and start < m.sinks:
        lines.append(translate("AttentionData", "attention sinks: always kept"))
    return "\n".join(lines)


def role_name(role: str) -> str:
    translate = QCoreApplication.translate
    return {"user": translate("AttentionData", "you"), "assistant": translate("AttentionData", "reply"),
            "system": translate("AttentionData", "system")}.get(role, role)
