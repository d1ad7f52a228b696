"""What the paged KV cache costs, from the architecture and the cache mode alone: no tensors.

The cache, the budget forecast, `kvchat bench memory` and `kvchat estimate` all read their bytes
here; the window rules (sink blocks, window start, blocks that leave) are written once, in kv/window.py.

A block holds `block_size` tokens of every layer's K and V. Quantized components also keep two
blocks in full precision per conversation: the block being filled (the tail, quantized once when
it is full) and the table's first block (the head: the first tokens, which draw most attention).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from kvchat.kernels.formats import FULL_DTYPES, PageFormat, bytes_per_block, page_format

from kvchat.engine.config import CacheConfig, ConfigError
from kvchat.engine.model.config import ModelConfig
from kvchat.engine.units import DTYPE_BYTES, MIB
from kvchat.engine.kv.window import (PREFILL_CHUNK, FullAttention, KeepImportant, ModelWindow,  # noqa: F401
                                     ReadChosen, SinkWindow, WindowGeometry, sinks_at_first_positions)



SUMMARY_BYTES = 2          # a key summary's max and min are bf16


def full_dtype(model_dtype: str, device: str) -> str:
    """The dtype "auto" means for the cache: 16 bits on the CPU (as llama.cpp's f16 cache), else the model's."""
    return "bf16" if str(device).startswith("cpu") and model_dtype == "fp32" else model_dtype


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Byte geometry of one cache mode on one model; hashable (pages of equal layouts are interchangeable)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    full_dtype: str                                            # what "auto" and the head/tail blocks use
    formats: tuple[tuple[PageFormat, PageFormat], ...]         # per layer: (K, V)
    layers: tuple[int, ...] = ()        # the model layers a KV group's layout holds, in order; (): all of them
    # per layer (KV heads, head_dim) where the layers differ (Gemma 4's global layers); (): all num_kv_heads x head_dim
    shapes: tuple[tuple[int, int], ...] = ()
    # a key summary per block and layer (query-aware retrieval, ReadChosen): per KV head the max and min of every
    # key channel, in bf16, counted in the block's bytes
    summary: bool = False
    # computed once: the manager asks for block bytes on every step
    layer_block_bytes: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    block_bytes: int = field(init=False, repr=False, compare=False)   # one block over all layers, K and V
    quantized_components: int = field(init=False, repr=False, compare=False)
    # one full-precision block of every quantized component (one tail, or one head, of each): the budget's
    # fixed bytes, asked on every step
    side_block_bytes: int = field(init=False, repr=False, compare=False)
    # a layout is part of every prefix-cache key: hashing its per-layer formats anew each time a block fills
    # took thousands of calls
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        per_layer = tuple(tuple(bytes_per_block(f, self.block_size, *self.layer_shape(j)) for f in pair)
                          for j, pair in enumerate(self.formats))
        object.__setattr__(self, "layer_block_bytes", per_layer)
        object.__setattr__(self, "block_bytes", sum(k + v for k, v in per_layer) + self.summary_bytes)
        object.__setattr__(self, "quantized_components", sum(f.is_quantized for pair in self.formats for f in pair))
        object.__setattr__(self, "side_block_bytes", sum(self.layer_full_block_bytes(j) for j, pair
                                                         in enumerate(self.formats) for f in pair if f.is_quantized))
        object.__setattr__(self, "_hash", hash((self.num_layers, self.num_kv_heads, self.head_dim, self.block_size,
                                                self.full_dtype, self.formats, self.layers, self.shapes,
                                                self.summary)))

    def __hash__(self) -> int:
        return self._hash

    def layer_shape(self, j: int) -> tuple[int, int]:
        """(KV heads, head_dim) of the layout's layer j."""
        return self.shapes[j] if self.shapes else (self.num_kv_heads, self.head_dim)

    @property
    def summary_bytes(self) -> int:
        """Bytes of one block's key summaries, every layer (0 without retrieval)."""
        if not self.summary:
            return 0
        return sum(2 * heads * dim * SUMMARY_BYTES for heads, dim in map(self.layer_shape, range(self.num_layers)))

    def layer_full_block_bytes(self, j: int) -> int:
        """Bytes of one full-precision block of one component of layer j (a head or a tail)."""
        heads, dim = self.layer_shape(j)
        return self.block_size * heads * dim * DTYPE_BYTES[self.full_dtype]

    @property
    def full_block_bytes(self) -> int:
        """Bytes of one full-precision block of one component (a head or a tail), of the model's head shape."""
        return self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.full_dtype]

    @property
    def fixed_bytes(self) -> int:
        """Most full-precision bytes one conversation keeps beside its blocks (a head and a tail per quantized component)."""
        return 2 * self.side_block_bytes

    @property
    def bytes_per_token(self) -> float:
        return self.block_bytes / self.block_size

    @property
    def full_precision_bytes_per_token(self) -> float:
        """What the same tokens would take with every component at full precision."""
        return 2 * sum(self.layer_full_block_bytes(j) for j in range(self.num_layers)) / self.block_size

    def blocks_for(self, num_slots: int) -> int:
        return -(-num_slots // self.block_size)

    def budget_blocks(self, budget_bytes: float, conversations: int = 1) -> int:
        """Blocks a budget holds beside the fixed bytes of `conversations` conversations."""
        return max(0, int((budget_bytes - conversations * self.fixed_bytes) // self.block_bytes))

    def side_bytes(self, num_slots: int, head: bool) -> int:
        """Full-precision bytes of one conversation holding num_slots slots: a tail once anything is written,
        a head while the first block is full and held."""
        if not self.quantized_components or num_slots == 0:
            return 0
        return self.side_block_bytes * (1 + int(head))

    def sequence_bytes(self, num_tokens: int, window: int | None = None, sinks: int = 0) -> int:
        """Bytes a conversation of num_tokens tokens holds in this layout, once its window (if any) slid."""
        g = FullAttention(self.block_size) if window is None else SinkWindow(self.block_size, window, sinks)
        blocks, evicted = g.steady_blocks(num_tokens)
        slots = num_tokens - evicted * self.block_size
        head = slots >= self.block_size and (g.sink_blocks > 0 or evicted == 0)
        return blocks * self.block_bytes + self.side_bytes(slots, head)

    def max_tokens(self, budget_bytes: float) -> int:
        """The longest conversation without a window whose KV fits in budget_bytes."""
        return self.budget_blocks(budget_bytes) * self.block_size


def _attention_layers(model) -> tuple[int, ...]:
    """The layers with a KV cache (ModelConfig.attention_layers; a bare shape, as the benches and tests pass: all)."""
    return tuple(getattr(model, "attention_layers", range(model.num_layers)))


def _state_bytes(model) -> int:
    """One conversation's recurrent state (ModelConfig.state_bytes; 0 for a bare shape)."""
    return model.state_bytes() if hasattr(model, "state_bytes") else 0


def _fit(fmt: PageFormat, head_dim: int) -> PageFormat:
    # groups of 32 channels need head_dim to split evenly; smaller heads use smaller groups
    if fmt.scale_axis == "group" and head_dim % fmt.group:
        return dataclasses.replace(fmt, group=math.gcd(fmt.group, head_dim))
    return fmt


def kv_layout(model: ModelConfig, cache: CacheConfig, model_dtype: str = "fp32", device: str = "cpu") -> KVLayout:
    """The layout of a cache mode on a model; raises ConfigError for layers the model lacks."""
    bad = [i for i in cache.full_precision_layers if i >= model.num_layers]
    if bad:
        raise ConfigError(f"full-precision layers {', '.join(map(str, bad))} do not exist: this model has layers "
                          f"0-{model.num_layers - 1}")
    dtype = full_dtype(model_dtype, device)
    formats = []
    attention = _attention_layers(model)        # a linear-attention layer keeps a state, no KV (kv/state.py)
    for i in sorted(set(cache.full_precision_layers) - set(attention)):
        source = getattr(model, "kv_sources", {}).get(i)
        why = (f"layer {i} reads layer {source}'s K and V: keep layer {source} in full precision instead"
               if source is not None else f"layer {i} keeps a recurrent state, not K and V")
        raise ConfigError(f"full-precision layer {i} holds no KV of its own: {why}")
    for layer in attention:
        if layer in cache.full_precision_layers:
            formats.append((PageFormat(dtype), PageFormat(dtype)))
        else:
            formats.append(tuple(_fit(page_format(f, role, cache.k_scheme, dtype), _shape(model, layer)[1])
                                 for f, role in ((cache.k_format, "k"), (cache.v_format, "v"))))
    assert dtype in FULL_DTYPES
    subset = () if len(attention) == model.num_layers else attention
    shapes = tuple(_shape(model, layer) for layer in attention)
    uniform = all(sh == (model.num_kv_heads, model.head_dim) for sh in shapes)
    return KVLayout(len(attention), model.num_kv_heads, model.head_dim, cache.block_size, dtype, tuple(formats),
                    subset, () if uniform else shapes, cache.retrieval_blocks is not None)


def _shape(model, layer: int) -> tuple[int, int]:
    """(KV heads, head_dim) of a model layer (a bare shape, as the benches pass: the model's)."""
    if hasattr(model, "layer_kv_heads"):
        return model.layer_kv_heads(layer), model.layer_head_dim(layer)
    return model.num_kv_heads, model.head_dim


def check_cache_for_model(cache: CacheConfig, model: ModelConfig, model_dtype: str = "fp32",
                          device: str = "cpu") -> KVLayout:
    """The one check of a cache mode against a model, shared by the engine and the Settings dialog: the
    layout, or a ConfigError saying what to change."""
    layout = kv_layout(model, cache, model_dtype, device)
    if cache.window is not None and cache.window + cache.sinks > model.max_position_embeddings:
        raise ConfigError(f"window {cache.window:,} + {cache.sinks} sinks is longer than the model's context of "
                          f"{model.max_position_embeddings:,} tokens: positions would run past what it was trained "
                          f"on; use a window of at most {model.max_position_embeddings - cache.sinks:,}")
    need = layout.block_bytes + layout.fixed_bytes
    state = _state_bytes(model)             # linear-attention layers' recurrent state, held from the first token
    if layout.budget_blocks(cache.budget_mb * MIB - state) < 1:
        held = f" beside the {state / MIB:.1f} MiB recurrent state of its linear-attention layers" if state else ""
        raise ConfigError(f"a KV budget of {cache.budget_mb:g} MiB does not hold even one block of {cache.block_size} "
                          f"tokens in {cache.label()} on this model{held} (that needs {(need + state) / MIB:.2f} MiB): "
                          f"raise the budget")
    if cache.window is not None:
        # a window holds its sinks, the window and one prompt chunk at once while a prompt is read
        geometry = WindowGeometry.of(cache)
        blocks = geometry.peak_blocks(geometry.prefill_chunk())
        if layout.budget_blocks(cache.budget_mb * MIB) < blocks:
            need_mb = math.ceil((blocks * layout.block_bytes + layout.fixed_bytes) / MIB * 10) / 10
            raise ConfigError(f"a KV budget of {cache.budget_mb:g} MiB cannot hold {cache.label()} on this model: "
                              f"reading a prompt into the window needs {need_mb:g} MiB; raise the budget to "
                              f"{need_mb:g} MiB or more, or lower the window")
    groups = kv_groups(model, cache, model_dtype, device)
    if len(groups) > 1:
        peak = hybrid_peak_bytes(groups, WindowGeometry.of(cache).prefill_chunk())
        if peak > cache.budget_mb * MIB:
            need_mb = math.ceil(peak / MIB * 10) / 10
            raise ConfigError(f"a KV budget of {cache.budget_mb:g} MiB cannot hold {cache.label()} on this model: "
                              f"reading a prompt into its sliding layers' windows needs {need_mb:g} MiB; raise the "
                              f"budget to {need_mb:g} MiB or more")
    return layout


# ---- hybrid models: layers with their own windows (Gemma 2 / 3, Phi-3's sliding window) ---------------------------

def layer_geometry(model: ModelConfig, cache: CacheConfig, layer: int) -> WindowGeometry:
    """What layer `layer` keeps: the smaller of its own window and the user's.

    A model window W (the layer's query at p reads keys p - W < k <= p) keeps W - 1 past tokens and no sinks, at
    absolute positions. The user's window (cache.window past tokens plus cache.sinks sinks, StreamingLLM) applies
    instead where it is the smaller one, or where the layer has no window of its own."""
    own = model.layers[layer].window
    if own is not None and (cache.window is None or own <= cache.window):
        return ModelWindow(cache.block_size, own - 1)
    return WindowGeometry.of(cache)


def layer_windows(model: ModelConfig, cache: CacheConfig) -> tuple[int | None, ...]:
    """The effective window of every layer (None: the layer holds every token): the smaller of its own and the
    user's (layer_geometry)."""
    out = []
    for i, spec in enumerate(model.layers):
        own, user = spec.window, cache.window
        out.append(user if own is None else own if user is None else min(own, user))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers that keep the same tokens (one geometry): one block table per conversation, blocks of its layers
    only (vLLM's KV cache group)."""

    layers: tuple[int, ...]
    geometry: WindowGeometry
    layout: KVLayout                    # the group's layers' formats (layer j of it is model layer layers[j])


def kv_groups(model: ModelConfig, cache: CacheConfig, model_dtype: str = "fp32",
              device: str = "cpu") -> tuple[KVGroup, ...]:
    """The model's KV groups under a cache mode, the one keeping the most first (then by first layer); one group,
    the whole layout, for a model whose layers all keep the same tokens (every model without windows of its
    own)."""
    full = kv_layout(model, cache, model_dtype, device)
    by_geometry: dict[WindowGeometry, list[int]] = {}
    for i in _attention_layers(model):
        by_geometry.setdefault(layer_geometry(model, cache, i), []).append(i)
    if len(by_geometry) == 1:
        (geometry, ids), = by_geometry.items()
        return (KVGroup(tuple(ids), geometry, full),)
    column = {layer: j for j, layer in enumerate(full.layers or range(model.num_layers))}
    # the group that keeps the most first: a conversation's tokens, statistics and limits are read from it
    order = sorted(by_geometry.items(), key=lambda item: (item[0].window is not None, -(item[0].window or 0),
                                                          item[1][0]))
    return tuple(KVGroup(tuple(ids), g, KVLayout(len(ids), full.num_kv_heads, full.head_dim, full.block_size,
                                                 full.full_dtype, tuple(full.formats[column[i]] for i in ids),
                                                 tuple(ids), _subset_shapes(full, [column[i] for i in ids]),
                                                 full.summary and isinstance(g, ReadChosen)))
                 for g, ids in order)


def _subset_shapes(full: KVLayout, columns: list[int]) -> tuple[tuple[int, int], ...]:
    """The per-layer shapes of some of a layout's layers; () where they are all the model's."""
    shapes = tuple(full.layer_shape(j) for j in columns)
    return () if all(sh == (full.num_kv_heads, full.head_dim) for sh in shapes) else shapes


def _group_bytes(group: KVGroup, num_tokens: int) -> int:
    g = group.geometry
    return group.layout.sequence_bytes(num_tokens, g.window, g.sinks)


def conversation_bytes(model: ModelConfig, cache: CacheConfig, num_tokens: int, model_dtype: str = "fp32",
                       device: str = "cpu") -> int:
    """KV bytes one conversation of num_tokens tokens holds, every group's blocks and full-precision head / tail
    (KVLayout.sequence_bytes of each group), and the recurrent state of its linear-attention layers (the same at any
    length; its snapshots aside)."""
    return sum(_group_bytes(g, num_tokens) for g in kv_groups(model, cache, model_dtype, device)) + _state_bytes(model)


def _peak_bytes(group: KVGroup, num_tokens: int) -> int:
    """The most bytes a windowed group held at any length up to num_tokens (its blocks rise, then level off as they
    leave): the group's bytes only change at block boundaries, and repeat once the window is full."""
    g, bs = group.geometry, group.layout.block_size
    horizon = min(num_tokens, g.window + g.sinks + 2 * bs)
    return max(_group_bytes(group, n) for n in {*range(0, horizon + 1, bs), *range(1, horizon + 1, bs), horizon})


def window_peak_bytes(layout: KVLayout, geometry: WindowGeometry) -> int:
    """The most bytes one windowed KV group's sequence (its layout, its geometry) holds at any length."""
    horizon = geometry.window + geometry.sinks + 2 * layout.block_size
    return _peak_bytes(KVGroup(layout.layers, geometry, layout), horizon)


def max_conversation_tokens(model: ModelConfig, cache: CacheConfig, budget_bytes: float, model_dtype: str = "fp32",
                            device: str = "cpu") -> int | None:
    """The longest conversation (whole blocks) whose KV fits in budget_bytes at every length on the way, or None
    when every layer is windowed (it never outgrows what it holds at its window). One group without a window:
    KVLayout.max_tokens."""
    groups = kv_groups(model, cache, model_dtype, device)
    growing = [g for g in groups if g.geometry.window is None]
    if not growing:
        return None
    budget_bytes -= _state_bytes(model)         # the linear-attention layers' state, held at any length
    if budget_bytes < 0:
        return 0
    if len(groups) == 1:
        return groups[0].layout.max_tokens(budget_bytes)
    bs = cache.block_size
    per_block = sum(g.layout.block_bytes for g in growing)
    fixed = sum(g.layout.fixed_bytes for g in growing)

    def fits(blocks: int) -> bool:
        n = blocks * bs
        return blocks * per_block + fixed + sum(_peak_bytes(g, n) for g in groups if g not in growing) <= budget_bytes

    lo, hi = 0, max(0, int(budget_bytes // per_block)) + 1      # fits(lo); not fits(hi)
    if not fits(0):
        return 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * bs


def cache_context(model: ModelConfig, cache: CacheConfig, model_dtype: str = "fp32", device: str = "cpu") -> int:
    """The most positions one conversation's attention spans under a cache config, within the model's context: a
    window's sinks and window (StreamingLLM re-positions them as one run), else what the budget holds. LongRoPE
    chooses its factors by it (ModelConfig.for_context)."""
    if cache.window is not None:
        return min(model.max_position_embeddings, cache.window + cache.sinks)
    held = max_conversation_tokens(model, cache, cache.budget_mb * MIB, model_dtype, device)
    return model.max_position_embeddings if held is None else min(model.max_position_embeddings, held)


def hybrid_peak_bytes(groups: tuple[KVGroup, ...], chunk: int) -> int:
    """Most bytes one conversation of several groups holds while a prompt chunk of `chunk` tokens is in flight and
    its full groups hold one block: each windowed group its sinks, window and the chunk, each group its sides."""
    total = 0
    for g in groups:
        blocks = 1 if g.geometry.window is None else g.geometry.peak_blocks(chunk)
        total += blocks * g.layout.block_bytes + g.layout.fixed_bytes
    return total


@functools.lru_cache(maxsize=16)
def layer_window_bytes(model: ModelConfig, cache: CacheConfig, model_dtype: str = "fp32",
                       device: str = "cpu") -> tuple[int | None, ...]:
    """Per layer, the most K and V bytes one conversation holds there once the layer's window is full (its blocks
    stop growing: the dashboard draws this line); None for a layer that holds every token. Cached: a snapshot asks
    after every step."""
    out: list[int | None] = [None] * model.num_layers
    for group in kv_groups(model, cache, model_dtype, device):
        g, lay = group.geometry, group.layout
        if g.window is None:
            continue
        for j, layer in enumerate(group.layers):
            heads, dim = lay.layer_shape(j)
            one = KVLayout(1, heads, dim, lay.block_size, lay.full_dtype, (lay.formats[j],))
            out[layer] = _peak_bytes(KVGroup((layer,), g, one), g.window + g.sinks + 2 * lay.block_size)
    return tuple(out)
