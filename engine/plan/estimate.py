"""`kvchat estimate`: what a model and a context cost in memory, before loading anything.

Architecture numbers come from a config.json or a GGUF header (or a preset of published numbers),
the KV bytes from engine.kv.layout (the same arithmetic the cache allocates with), the stored weight
bytes from the file (a GGUF's tensor bytes, a folder's safetensors sizes, or a preset's parameter count
times the bytes per weight of a chosen GGUF type), and what they hold once loaded and the reserve beside
them from engine.plan.fit, the planner the loader refuses with. A mixture of experts holds every expert, so
what fits is planned with all of them; what one decoded token reads (attention, router, the experts it is
routed to, the output head) is said beside it, since that, not the file, is what bounds its decode speed.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field

from kvchat.engine.config import CacheConfig, ConfigError
from kvchat.engine.errors import ModelLoadError
from kvchat.engine.model.config import ModelConfig
from kvchat.engine.plan.fit import (FREE_SHARE, RUNTIME_BYTES, gguf_read_bytes, margin_for, model_dtype_for,
                                    nvml_free, parameter_count, parameter_counts, resident_bytes,
                                    safetensors_read_bytes, safetensors_summary)
from kvchat.engine.plan.presets import PRESET_CONFIGS, preset
from kvchat.engine.units import GIB, MIB, format_size

FORMATS = ("fp32", "fp16", "bf16", "int8", "fp8", "int4")
MAX_SEARCH_TOKENS = 1 << 31


def bytes_per_weight(type_name: str) -> float:
    """Bytes one weight takes in a GGUF tensor type (F16: 2, Q8_0: 34/32, Q4_K: 144/256 ...)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name.upper()]]
    except KeyError:
        raise ConfigError(f"weight type {type_name!r} is not a GGUF tensor type: try F16, BF16, Q8_0, Q6_K, "
                          f"Q4_K or Q4_0") from None
    return size / block


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What a model is and weighs, from its header alone."""

    name: str
    source: str                     # "gguf", "safetensors" or "preset"
    config: ModelConfig
    parameters: int
    weight_bytes: int
    weights_label: str              # "Q4_1 (+Q8_0)", "bf16", "F16 (preset: 2 B a weight)"
    # what one decoded token reads of them (a mixture of experts: attention, router, its used experts, the head);
    # None: computed from the config as a share of the whole
    active_parameters: int | None = None
    active_bytes: int | None = None

    def __post_init__(self):
        total, active = parameter_counts(self.config)
        if self.active_parameters is None:
            object.__setattr__(self, "active_parameters", min(self.parameters, active) if self.parameters else active)
        if self.active_bytes is None:
            share = active / total if total else 1.0
            object.__setattr__(self, "active_bytes", int(self.weight_bytes * share))


def model_facts(model: str, weights_type: str = "F16") -> ModelFacts:
    """Facts of "default", a preset name, a .gguf file or a Hugging Face folder; reads headers only."""
    key = model.lower()
    if key in PRESET_CONFIGS:
        mc = preset(key)
        params, active = parameter_counts(mc)
        per = bytes_per_weight(weights_type)
        return ModelFacts(key, "preset", mc, params, int(params * per),
                          f"{weights_type.upper()} (preset: {per:.4g} B a weight)", active, int(active * per))
    from kvchat.engine.model.source import locate
    files = locate(model)
    return model_facts_from(files.path, files.name)


def model_facts_from(path, name: str | None = None) -> ModelFacts:
    """Facts of a GGUF file (whatever its name: Ollama's blobs have no suffix) or a Hugging Face folder."""
    from pathlib import Path

    from kvchat.engine.model.gguf_view import GGUFModel
    from kvchat.engine.model.source import read_config
    from kvchat.engine.model.families import check_architecture
    path = Path(path)
    name = name or path.stem
    if path.is_dir():
        cfg = read_config(path)
        check_architecture(str(cfg.get("model_type")), str(path / "config.json"))
        mc = ModelConfig.from_hf(cfg)
        params, size, dtype = safetensors_summary(path)
        return ModelFacts(name, "safetensors", mc, params, size, dtype,
                          active_bytes=safetensors_read_bytes(path, mc) if _routed(mc) else None)
    gf = GGUFModel(path)
    params = sum(math.prod(t.shape) for t in gf.tensors.values())
    mc = ModelConfig.from_gguf(gf)
    return ModelFacts(name, "gguf", mc, params, gf.tensor_bytes, gf.quant_summary(),
                      active_bytes=gguf_read_bytes(gf, mc) if _routed(mc) else None)


def _routed(mc: ModelConfig) -> bool:
    return any(layer.experts is not None for layer in mc.layers)


def experts_of(mc: ModelConfig) -> tuple[int, int]:
    """(experts, used per token) of a mixture of experts' routed layers; () for a dense model."""
    ex = next((layer.experts for layer in mc.layers if layer.experts is not None), None)
    return (ex.count, ex.used) if ex is not None else ()


def resolve_device(device: str) -> str:
    """auto: cuda when the NVIDIA driver reports a GPU (pynvml; torch's CUDA is not started), else cpu."""
    if device != "auto":
        return device
    return "cuda" if nvml_free() is not None else "cpu"


def available_memory(device: str) -> tuple[int, str]:
    """(bytes, where they were read): free VRAM of GPU 0 via pynvml on cuda, else available RAM via psutil."""
    if device.startswith("cuda"):
        free = nvml_free()
        if free is not None:
            return free, "free GPU memory (pynvml)"
    import psutil
    return int(psutil.virtual_memory().available), "available RAM (psutil)"


def parse_format(text: str) -> tuple[str, str]:
    """"int8" -> (int8, int8); "int4/int8" -> K int4, V int8."""
    k, _, v = text.partition("/")
    return k, v or k


def cache_for(fmt: str, block_size: int = 16, window: int | None = None, sinks: int = 4,
              k_scheme: str = "channel", fp_layers: tuple[int, ...] = ()) -> CacheConfig:
    k, v = parse_format(fmt)
    return CacheConfig(k_format=k, v_format=v, k_scheme=k_scheme, full_precision_layers=fp_layers,
                       window=window, sinks=sinks, block_size=block_size)


def largest_context(layout, budget_bytes: float, window: int | None = None, sinks: int = 0,
                    batch: int = 1) -> int | None:
    """The most tokens each of `batch` conversations can reach with every step fitting in budget_bytes;
    None when a window bounds the memory below the budget (any length fits)."""
    from kvchat.engine.kv.layout import SinkWindow
    per = budget_bytes / batch

    def fits(n: int) -> bool:
        return layout.sequence_bytes(n, window, sinks) <= per

    if not fits(1):
        return 0
    if window is None:
        lo, hi = 1, 2
        while hi < MAX_SEARCH_TOKENS and fits(hi):
            lo, hi = hi, hi * 2
        if hi >= MAX_SEARCH_TOKENS and fits(hi):
            return None
        return _last_fitting(fits, lo, hi)
    # bytes grow with the tokens until the first block leaves the window; from then they repeat with a
    # period of one block, so one period past that point holds the peak
    bs = layout.block_size
    first_eviction = window + (SinkWindow(bs, window, sinks).sink_blocks + 1) * bs
    if not fits(first_eviction - 1):
        return _last_fitting(fits, 1, first_eviction - 1)
    for n in range(first_eviction, first_eviction + bs):
        if not fits(n):
            return n - 1
    return None


def window_counts(windows) -> tuple[tuple[int | None, int], ...]:
    """(window, layers) per distinct window of a per-layer tuple, sliding ones first by window, then the layers
    that hold every token (None): ((512, 22), (None, 4)) for Gemma-3 1B."""
    counts: dict[int | None, int] = {}
    for w in windows:
        counts[w] = counts.get(w, 0) + 1
    return tuple(sorted(counts.items(), key=lambda item: (item[0] is None, item[0] or 0)))


def describe_windows(windows) -> str:
    """"22 sliding 512 + 4 global" for a hybrid model; "" when every layer keeps the same tokens."""
    counts = window_counts(windows)
    if len(counts) < 2:
        return ""
    return " + ".join(f"{n} global" if w is None else f"{n} sliding {w:,}" for w, n in counts)


def growth_bytes_per_token(groups) -> float:
    """KV bytes each token adds once the sliding layers' windows are full: only the groups without a window grow."""
    return sum(g.layout.bytes_per_token for g in groups if g.geometry.window is None)


def _last_fitting(fits, lo: int, hi: int) -> int:
    # fits(lo) holds, fits(hi) does not; bytes never shrink in between
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


@dataclass(frozen=True, slots=True)
class FormatEstimate:
    format: str                     # "int8", or "int4/int8" for K int4, V int8
    label: str                      # the layout's own words, e.g. "K int8 (per channel/block) / V int8 (per token)"
    bytes_per_token: float          # what each token adds in steady state, K and V, scales included: every layer,
                                    # or a hybrid model's layers without a window (the sliding ones stay flat)
    full_precision_bytes: int       # head/tail blocks kept in full precision, per conversation (at most)
    kv_bytes: int                   # the context x batch, exactly what the cache holds
    total_bytes: int                # weights + KV
    max_context: int | None         # largest context per conversation beside the weights; None: unbounded (window)
    fits: bool                      # the asked context fits in the memory beside the weights and the margin


@dataclass(frozen=True, slots=True)
class Estimate:
    model: str
    source: str
    architecture: str
    parameters: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    trained_context: int
    weights_label: str
    weight_bytes: int               # what the weights hold once loaded on the device (engine.plan.fit.resident_bytes)
    context: int
    batch: int
    block_size: int
    window: int | None
    sinks: int
    device: str
    full_dtype: str                 # what full-precision head/tail blocks and fp layers use
    memory_bytes: int
    memory_source: str
    margin_bytes: int               # runtime allowance + share of memory kept free (engine.plan.fit.margin_for)
    kv_room_bytes: int              # memory - weights - margin: what the KV cache may take
    rows: tuple[FormatEstimate, ...] = field(default_factory=tuple)
    # (window, layers) of the model's own attention windows: ((512, 22), (None, 4)) for Gemma-3 1B; None: all tokens
    layer_windows: tuple[tuple[int | None, int], ...] = ()
    # a mixture of experts: (experts, used per token); what fits holds every expert, while one decoded token reads
    # only active_weight_bytes of weight_bytes (active_parameters of parameters)
    experts: tuple[int, ...] = ()
    active_parameters: int = 0
    active_weight_bytes: int = 0
    # linear-attention layers (a recurrent state instead of KV): how many, and the state one conversation holds in
    # them (counted in kv_bytes), the same at any length; each snapshot of it (regenerate, rewind) costs as much
    linear_layers: int = 0
    state_bytes: int = 0
    # layers that read another layer's K and V (Gemma 4's last ones): they hold none, and layer_windows leaves them out
    shared_kv_layers: int = 0
    # (KV heads, head_dim) of the layers whose heads differ from the model's (Gemma 4's global layers), one per shape
    other_heads: tuple[tuple[int, int], ...] = ()

    def to_json(self) -> dict:
        return asdict(self)


def estimate(facts: ModelFacts, context: int, batch: int = 1, formats=FORMATS, block_size: int = 16,
             window: int | None = None, sinks: int = 4, k_scheme: str = "channel", fp_layers: tuple[int, ...] = (),
             memory_bytes: int | None = None, memory_source: str = "", device: str = "cpu",
             dtype: str = "auto", weights: str = "auto", packed: bool | None = None) -> Estimate:
    """packed: whether a GGUF's blocks stay packed on `device` (default: the loader's rule, fit.packs_gguf)."""
    from kvchat.engine.kv.layout import conversation_bytes, kv_groups, kv_layout, max_conversation_tokens
    if context < 1:
        raise ConfigError(f"context={context}: ask for at least 1 token")
    if batch < 1:
        raise ConfigError(f"batch={batch}: ask for at least 1 conversation")
    if memory_bytes is None:
        memory_bytes, memory_source = available_memory(device)
    margin = margin_for(memory_bytes)
    weight_bytes = resident_bytes(facts.config, facts.weight_bytes, weights, device, dtype, facts.source,
                                  facts.weights_label, packed=packed)
    active_bytes = resident_bytes(facts.config, facts.active_bytes, weights, device, dtype, facts.source,
                                  facts.weights_label, params=facts.active_parameters, packed=packed)
    room = max(0, memory_bytes - weight_bytes - margin)
    model_dtype = model_dtype_for(dtype, device)
    mc = facts.config
    rows, full = [], ""
    for fmt in formats:
        cache = cache_for(fmt, block_size, window, sinks, k_scheme, fp_layers)
        layout = kv_layout(mc, cache, model_dtype, device)
        groups = kv_groups(mc, cache, model_dtype, device)
        full = layout.full_dtype
        kv = batch * conversation_bytes(mc, cache, context, model_dtype, device)
        kinds = {f.label for pair in layout.formats for f in pair}
        if len(groups) == 1:            # every layer keeps the same tokens: to the token, as before
            g = groups[0].geometry
            state_room = max(0, room - batch * mc.state_bytes())     # a linear-attention model's state first
            per_token, longest = layout.bytes_per_token, largest_context(layout, state_room, g.window, g.sinks, batch)
        else:                           # the engine's own forecast for layers that keep different tokens
            per_token = growth_bytes_per_token(groups)
            longest = max_conversation_tokens(mc, cache, room / batch, model_dtype, device)
        rows.append(FormatEstimate(
            format=fmt, label=", ".join(sorted(kinds)), bytes_per_token=per_token,
            full_precision_bytes=layout.fixed_bytes, kv_bytes=kv, total_bytes=weight_bytes + kv,
            max_context=longest, fits=kv <= room))
    return Estimate(facts.name, facts.source, mc.model_type, facts.parameters, mc.num_layers, mc.num_kv_heads,
                    mc.head_dim, mc.max_position_embeddings, facts.weights_label, weight_bytes, context, batch,
                    block_size, window, sinks, device, full, memory_bytes, memory_source, margin, room, tuple(rows),
                    window_counts(layer.window for layer in mc.layers if layer.own_kv), experts_of(mc),
                    facts.active_parameters, min(active_bytes, weight_bytes), len(mc.linear_layers), mc.state_bytes(),
                    len(mc.kv_sources), tuple(sorted({(mc.layer_kv_heads(i), mc.layer_head_dim(i))
                                                      for i in mc.attention_layers} - {(mc.num_kv_heads, mc.head_dim)})))


# ------------------------------------------------------------------------------------------------- CLI

def _tokens(n: int | None, trained: int) -> str:
    if n is None:
        return "unbounded (window)"
    note = " (past trained)" if n > trained else ""
    return f"{n:,}{note}"


def summarize(e: Estimate) -> str:
    window = f", window {e.window} + {e.sinks} sinks" if e.window is not None else ""
    hybrid = describe_windows(w for w, n in e.layer_windows for _ in range(n))
    moe = ""
    if e.experts:
        moe = (f", {e.experts[1]} of {e.experts[0]} experts per token ({e.active_parameters / 1e9:.2f} B parameters "
               f"read per token)")
    if e.shared_kv_layers:
        hybrid = f"{hybrid or f'{e.num_layers - e.shared_kv_layers} own KV'} + {e.shared_kv_layers} sharing KV"
    heads = "".join(f" (and {h} x {d})" for h, d in e.other_heads)
    lines = [
        f"{e.model} ({e.source}): {e.architecture}, {e.parameters / 1e9:.2f} B parameters{moe}, {e.num_layers} layers"
        f"{f' ({hybrid})' if hybrid else ''}, "
        f"{e.num_kv_heads} KV heads x head_dim {e.head_dim}{heads}, trained context {e.trained_context:,}",
        f"weights {format_size(e.weight_bytes)} ({e.weights_label}"
        f"{f'; every expert held, {format_size(e.active_weight_bytes)} read per token' if e.experts else ''}); "
        f"context {e.context:,} x batch {e.batch}, "
        f"blocks of {e.block_size}{window}; full-precision blocks in {e.full_dtype}",
        f"memory {format_size(e.memory_bytes)} ({e.memory_source}); margin {format_size(e.margin_bytes)} "
        f"({RUNTIME_BYTES // MIB} MiB runtime + {FREE_SHARE:.0%} kept free); room for KV {format_size(e.kv_room_bytes)}",
        "",
        f"{'format':<10} {'B/token':>12} {'KV':>12} {'total':>12} {'fits':>5}  {'largest context':>22}",
    ]
    if e.linear_layers:
        lines.insert(-1, f"{e.linear_layers} of {e.num_layers} layers are linear attention: their recurrent state, "
                         f"{format_size(e.state_bytes)} a conversation at any length, is in KV (each snapshot kept for "
                         f"regenerate and rewind adds as much); B/token and the cache formats are the "
                         f"{e.num_layers - e.linear_layers} attention "
                         f"{'layer' + chr(39) + 's' if e.num_layers - e.linear_layers == 1 else 'layers' + chr(39)}")
    if e.shared_kv_layers:
        lines.insert(-1, f"{e.shared_kv_layers} of {e.num_layers} layers read the K and V of an earlier layer: they "
                         f"hold none of their own (the formats apply to the layers they read)")
    if len(e.layer_windows) > 1:
        lines.insert(-1, f"B/token: what each token adds once the sliding windows are full (only the "
                         f"{dict(e.layer_windows).get(None, 0)} global layers holding KV grow)")
    for r in e.rows:
        lines.append(f"{r.format:<10} {r.bytes_per_token:>12,.1f} {format_size(r.kv_bytes):>12} {format_size(r.total_bytes):>12} "
                     f"{'yes' if r.fits else 'NO':>5}  {_tokens(r.max_context, e.trained_context):>22}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help=f"default, a .gguf file, a Hugging Face folder, or a preset: {', '.join(PRESET_CONFIGS)}")
    p.add_argument("--context", type=int, required=True, help="tokens per conversation")
    p.add_argument("--batch", type=int, default=1, help="conversations held at once")
    p.add_argument("--format", default="all",
                   help="all, or comma-separated cache formats (fp32 fp16 bf16 int8 fp8 int4); K/V as int4/int8")
    p.add_argument("--k-scheme", default="channel", choices=["channel", "token"])
    p.add_argument("--fp-layers", default="", help="comma-separated layers kept in full precision")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--window", type=int, default=None)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--memory-gb", type=float, default=None,
                   help="memory to plan for, in GiB (default: free GPU memory, else available RAM)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda: where the model would run")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16"])
    p.add_argument("--weights", default="auto", choices=["auto", "dense", "int8", "int4"],
                   help="how the weights would load: auto (a GGUF packed, a folder at its stored dtype), dense, int8, int4")
    p.add_argument("--weights-type", default="F16", help="presets only: the GGUF type of the weights (F16, Q8_0, Q4_K ...)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> Estimate:
    formats = FORMATS if args.format == "all" else tuple(f.strip() for f in args.format.split(",") if f.strip())
    for f in formats:
        for part in parse_format(f):
            if part not in FORMATS:
                raise ConfigError(f"format {part!r}: choose from {', '.join(FORMATS)} (or all)")
    fp_layers = tuple(int(x) for x in args.fp_layers.split(",") if x.strip())
    device = resolve_device(args.device)
    memory = source = None
    if args.memory_gb is not None:
        if args.memory_gb <= 0:
            raise ConfigError(f"--memory-gb {args.memory_gb}: give the memory to plan for as a positive number of GiB")
        memory, source = int(args.memory_gb * GIB), f"{args.memory_gb:g} GiB as given"
    facts = model_facts(args.model, args.weights_type)
    return estimate(facts, args.context, args.batch, formats, args.block_size, args.window, args.sinks,
                    args.k_scheme, fp_layers, memory, source or "", device, args.dtype, args.weights)


def cmd_estimate(args) -> int:
    try:
        result = run(args)
    except (ConfigError, ModelLoadError, ValueError) as exc:
        print(f"kvchat estimate: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_json(), indent=2) if args.json else summarize(result))
    return 0

