"""Facts about the loaded model that the dashboard needs and a StatsSnapshot may not carry yet.

The engine is expected to fill StatsSnapshot.full_precision_bytes_per_token and .context_tokens;
until it does (0 means unknown), the engine thread completes each snapshot from the model's shape.
"""
from __future__ import annotations

from dataclasses import replace

from engine.events import StatsSnapshot

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def model_facts(engine) -> dict[str, float]:
    """{"full_precision_bytes_per_token": ..., "context_tokens": ...} as far as the engine tells them."""
    config = getattr(getattr(engine, "model", None), "config", None)
    if config is None:
        return {}
    facts: dict[str, float] = {}
    element = DTYPE_BYTES.get(getattr(engine, "dtype_name", ""), 0)
    shape = [getattr(config, name, 0) for name in ("num_layers", "num_kv_heads", "head_dim")]
    if element and all(shape):
        # K and V, every layer, every kv head, at the model dtype: what an unquantized cache holds
        facts["full_precision_bytes_per_token"] = float(2 * shape[0] * shape[1] * shape[2] * element)
    if getattr(config, "max_position_embeddings", 0):
        facts["context_tokens"] = int(config.max_position_embeddings)
    return facts


def complete(snapshot: StatsSnapshot | None, facts: dict[str, float]) -> StatsSnapshot | None:
    """The snapshot with the fields the engine left at 0 filled from `facts`."""
    if snapshot is None:
        return None
    missing = {name: value for name, value in facts.items() if not getattr(snapshot, name)}
    return replace(snapshot, **missing) if missing else snapshot
