"""How long the saved conversations are, what they would hold in the KV cache, and a window for the long ones.

Plain Python (no Qt): token counts come from the model's tokenizer in the engine thread (bridge/measure.py);
bytes from engine.kv.layout, the cache's own arithmetic.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from PySide6.QtCore import QCoreApplication

from kvchat.engine.config import CacheConfig
from kvchat.engine.kv.layout import conversation_bytes

from kvchat.app.dashboard.bar_widgets import format_mib

FIRST_EDGE = 256                        # histogram bins: <256, 256-511, 512-1,023, ... tokens
MIN_WINDOW = 512


@dataclass(frozen=True, slots=True)
class Bin:
    low: int                            # tokens, inclusive
    high: int | None                    # exclusive; None: open-ended
    count: int
    num_bytes: int                      # KV bytes its conversations would hold, all at once

    @property
    def label(self) -> str:
        return f"<{_short(self.high)}" if self.low == 0 else f"{_short(self.low)}+"

    @property
    def range_text(self) -> str:
        if self.high is None:
            return QCoreApplication.translate("Lengths", "{n} tokens or more").format(n=f"{self.low:,}")
        if self.low == 0:
            return QCoreApplication.translate("Lengths", "fewer than {n} tokens").format(n=f"{self.high:,}")
        return QCoreApplication.translate("Lengths", "{low}-{high} tokens").format(low=f"{self.low:,}",
                                                                                  high=f"{self.high - 1:,}")


def _short(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else f"{n:,}"


def histogram(tokens: list[int], bytes_of, max_bins: int = 8) -> list[Bin]:
    """Doubling bins from FIRST_EDGE up to the longest conversation; the last bin is open-ended past max_bins."""
    if not tokens:
        return []
    edges = [0, FIRST_EDGE]
    while edges[-1] <= max(tokens) and len(edges) < max_bins:
        edges.append(edges[-1] * 2)
    bins = []
    for i, low in enumerate(edges):
        high = edges[i + 1] if i + 1 < len(edges) else None
        members = [n for n in tokens if n >= low and (high is None or n < high)]
        if high is None and not members:
            continue
        bins.append(Bin(low, high, len(members), sum(bytes_of(n) for n in members)))
    return bins


@dataclass(frozen=True, slots=True)
class WindowSuggestion:
    window: int
    sinks: int
    num_long: int                       # conversations longer than window + sinks
    num_total: int
    long_share: float                   # of the KV bytes all conversations would hold, 0.0-1.0
    cap_bytes: int                      # the most any long conversation holds with the window
    saved_bytes: int                    # bytes the window takes off the long conversations together
    format_label: str

    def text(self) -> str:
        return QCoreApplication.translate(
            "Lengths", "{long} of {total} conversations are over {tokens} tokens and hold {share} of the KV all of "
            "them would take ({mode}): a window of {window} + {sinks} sinks would cap each at {cap} (saving {saved} "
            "together), and leave the other {rest} whole.").format(
            long=self.num_long, total=self.num_total, tokens=f"{self.window + self.sinks:,}",
            share=f"{self.long_share:.0%}", mode=self.format_label, window=f"{self.window:,}", sinks=self.sinks,
            cap=format_mib(self.cap_bytes), saved=format_mib(self.saved_bytes), rest=self.num_total - self.num_long)


def typical_window(tokens: list[int], context: int, sinks: int) -> int:
    """The smallest power-of-two window (MIN_WINDOW at least) at or above the median length, the median the page's
    summary shows: at least half of the conversations stay whole. Within the model's context when it has one."""
    window = MIN_WINDOW
    while window < statistics.median(tokens):
        window *= 2
    return min(window, max(1, context - sinks)) if context else window


def suggest_window(tokens: list[int], layout, context: int, sinks: int, format_label: str) -> WindowSuggestion | None:
    """The typical window (typical_window), when conversations longer than it exist.

    `layout` is the chat's formats on the model (ConversationBytes, or a KVLayout where every layer keeps the same
    tokens); its sequence_bytes gives both sides of the comparison, and the chart's bytes."""
    if not tokens:
        return None
    window = typical_window(tokens, context, sinks)
    long = [n for n in tokens if n > window + sinks]
    if not long:
        return None
    full = {n: layout.sequence_bytes(n) for n in set(tokens)}
    capped = {n: layout.sequence_bytes(n, window, sinks) for n in set(long)}
    total = sum(full[n] for n in tokens) or 1
    return WindowSuggestion(window, sinks, len(long), len(tokens), sum(full[n] for n in long) / total,
                            max(capped.values()), sum(full[n] - capped[n] for n in long), format_label)


def no_window_text(tokens: list[int], context: int, sinks: int) -> str:
    """Why no window is suggested, in the numbers the summary shows (suggest_window found no conversation longer
    than the typical window)."""
    window = typical_window(tokens, context, sinks)
    assert max(tokens) <= window + sinks, "conversations are longer than the window: suggest_window has one"
    return QCoreApplication.translate(
        "Lengths", "No conversation is over {tokens} tokens (median {median}, longest {longest}): a window of {window} "
        "+ {sinks} sinks would keep every one whole, so none is needed.").format(
        tokens=f"{window + sinks:,}", median=f"{statistics.median(tokens):,.0f}", longest=f"{max(tokens):,}",
        window=f"{window:,}", sinks=sinks)


def kv_shares(sizes: list[int]) -> list[float]:
    """Each conversation's KV bytes over the bytes all of them hold together, wherever they are (the pool, host
    memory, disk): a chat only on disk is not in the pool, so the pool's held bytes do not contain it. Each share is
    0.0-1.0 and together they make 1."""
    total = sum(sizes)
    return [n / total if total else 0.0 for n in sizes]


class ConversationBytes:
    """What one conversation of n tokens holds on a model in the chat's formats (engine.kv.layout's
    conversation_bytes, so a hybrid model's sliding layers count their window only), with the user's window and
    sinks as asked: the `layout` histogram and suggest_window read, cached per length."""

    def __init__(self, model_config, cache: CacheConfig, model_dtype: str, device: str):
        self.model_config, self.cache, self.model_dtype, self.device = model_config, cache, model_dtype, device
        self._bytes: dict[tuple[int, int | None, int], int] = {}

    def sequence_bytes(self, num_tokens: int, window: int | None = None, sinks: int = 0) -> int:
        key = (num_tokens, window, sinks)
        if key not in self._bytes:
            cache = self.cache.with_(window=window, sinks=sinks) if window is not None else without_window(self.cache)
            self._bytes[key] = conversation_bytes(self.model_config, cache, num_tokens, self.model_dtype, self.device)
        return self._bytes[key]


def without_window(cache: CacheConfig) -> CacheConfig:
    return cache.with_(window=None) if cache.window is not None else cache
