"""Facts about the loaded model that the dashboard needs and a StatsSnapshot may not carry yet.

The engine is expected to fill StatsSnapshot.full_precision_bytes_per_token and .context_tokens;
until it does (0 means unknown), the engine thread completes each snapshot from the model's shape.
"""
from __future__ import annotations

from dataclasses import replace

from PySide6.QtCore import QCoreApplication

from kvchat.engine.config import CacheConfig
from kvchat.engine.events import StatsSnapshot
from kvchat.engine.kv.layout import kv_layout
from kvchat.engine.model.families import family
from kvchat.engine.plan.estimate import window_counts


def model_facts(config, model_dtype: str, device: str) -> dict[str, float]:
    """{"full_precision_bytes_per_token": ..., "context_tokens": ...} of a loaded model (config None: a server's,
    unknown). The bytes are the engine's own layout arithmetic for an unquantized cache on this device, so the
    dashboard's outline and the engine's own snapshots cannot disagree."""
    if config is None:
        return {}
    facts: dict[str, float] = {"full_precision_bytes_per_token":
                               kv_layout(config, CacheConfig(), model_dtype, device).full_precision_bytes_per_token}
    if config.max_position_embeddings:
        facts["context_tokens"] = int(config.max_position_embeddings)
    return facts


def complete(snapshot: StatsSnapshot | None, facts: dict[str, float]) -> StatsSnapshot | None:
    """The snapshot with the fields the engine left at 0 filled from `facts`."""
    if snapshot is None:
        return None
    missing = {name: value for name, value in facts.items() if not getattr(snapshot, name)}
    return replace(snapshot, **missing) if missing else snapshot


def family_text(config) -> str:
    """"gemma3 · 26 layers (22 sliding 512 + 4 global)" for the status line: the family and, where layers keep
    different tokens, how many slide over which window and how many hold everything; a mixture of experts adds
    "128 experts, 8 active per token" (and in how many layers, where some are dense), gpt-oss its learned attention
    sinks. Qwen3.5 says how many of its layers are linear attention (a state, not KV): "4 layers (3 linear attention
    + 1 attention)"; Gemma 4 how many read an earlier layer's KV, the windows counting the layers that hold their own:
    "42 layers (20 sliding 512 + 4 global + 18 sharing KV)"."""
    translate = QCoreApplication.translate
    own, linear, shared = len(config.attention_layers), len(config.linear_layers), len(config.kv_sources)
    counts = window_counts(config.layers[i].window for i in config.attention_layers)
    layers = translate("EngineFacts", "{n} layers").format(n=config.num_layers)
    kinds = [translate("EngineFacts", "{n} linear attention").format(n=linear)] if linear else []
    if len(counts) > 1:
        kinds += [translate("EngineFacts", "{n} global").format(n=n) if w is None else
                  translate("EngineFacts", "{n} sliding {window}").format(n=n, window=f"{w:,}") for w, n in counts]
    elif shared:
        kinds.append(translate("EngineFacts", "{n} own KV").format(n=own))
    elif kinds:
        kinds.append(translate("EngineFacts", "{n} attention").format(n=own))
    if shared:
        kinds.append(translate("EngineFacts", "{n} sharing KV").format(n=shared))
    if kinds:
        layers += " (" + " + ".join(kinds) + ")"
    parts = [family(config.model_type, "the loaded model").name, layers]
    routed = [layer.experts for layer in config.layers if layer.experts is not None]
    if routed:
        experts = " / ".join(translate("EngineFacts", "{n} experts, {k} active per token").format(n=f"{n:,}", k=k)
                             for n, k in sorted({(e.count, e.used) for e in routed}))
        if len(routed) < config.num_layers:
            experts += translate("EngineFacts", " in {routed} of {layers} layers").format(routed=len(routed),
                                                                                       layers=config.num_layers)
        parts.append(experts)
    if any(layer.sink_logits for layer in config.layers):
        parts.append(translate("EngineFacts", "learned attention sinks"))
    return " · ".join(parts)
