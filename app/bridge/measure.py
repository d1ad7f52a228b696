"""The engine thread's measurements for the dashboard: a cache mode's quality against full precision, and the
tokens saved conversations take. They hold the engine, so they live beside the worker; what they return are
frozen results (store/quality.py, dashboard/lengths_data.py) the window keeps and draws.
"""
from __future__ import annotations

import time
from typing import Callable

from kvchat.engine.config import CacheConfig, ConfigError
from kvchat.engine.kv.layout import MIB, kv_layout

from kvchat.app.bridge.messages import TokenCounts
from kvchat.app.store.quality import QUALITY_STEP, QUALITY_TEXT, QUALITY_TOKENS, QualityResult, model_key, result_key, \
    tokens_to_measure


def engine_key(engine) -> str:
    facts = engine.describe()
    return model_key(facts.model_name, facts.weights_label, facts.dtype_name, facts.device)


def measure(engine, cache: CacheConfig, should_stop: Callable[[], bool] | None = None,
            num_tokens: int = QUALITY_TOKENS) -> QualityResult:
    """Teacher-force the built-in text through full precision and `cache` in lockstep: num_tokens tokens, or for a
    window mode num_tokens past the window and its sinks (tokens_to_measure).

    Raises engine.runtime.fidelity.Cancelled when should_stop answers True between steps, ConfigError when the
    mode cannot be measured."""
    from kvchat.engine.runtime.fidelity import compare_modes
    from kvchat.engine.text.samples import load_tokens

    started = time.perf_counter()
    n, context = tokens_to_measure(cache, num_tokens), engine.model.config.max_position_embeddings
    if cache.window is not None and n > context:
        raise ConfigError(f"a window of {cache.window:,} + {cache.sinks} sinks slides only past {n - num_tokens:,} "
                          f"tokens, and measuring it reads {n:,}, more than this model's {context:,}-token context: "
                          f"not measured")
    try:
        ids = load_tokens(engine.tokenizer, QUALITY_TEXT, n)
    except ValueError:
        raise ConfigError(f"the built-in text is shorter than the {n:,} tokens measuring this mode reads: "
                          f"not measured") from None
    _check_room(engine, cache, len(ids))
    result = compare_modes(engine, ids, {"mode": cache}, step=QUALITY_STEP, should_stop=should_stop)["mode"]
    if int(result["tokens"]) != len(ids) or not result["kv_bytes"]:
        raise ConfigError(f"only {int(result['tokens'])} of {len(ids)} tokens were compared, with "
                          f"{int(result['kv_bytes'])} bytes cached: nothing was measured")
    if cache.window is not None and result["tokens_held"] >= len(ids):
        raise ConfigError(f"the window of {cache.window:,} + {cache.sinks} sinks never slid over the {len(ids):,} "
                          f"tokens read: not measured")
    return QualityResult(engine_key(engine), result_key(cache), float(result["top1_agreement"]),
                         float(result["mean_kl"]), int(result["tokens"]), time.perf_counter() - started)


def _check_room(engine, cache: CacheConfig, num_tokens: int) -> None:
    """The measurement holds the text at full precision and in the mode at once, in the engine's budget."""
    model, dtype, device = engine.model.config, engine.dtype_name, str(engine.device)
    full = kv_layout(model, CacheConfig(k_format=dtype, v_format=dtype), dtype, device)
    mode = kv_layout(model, cache.with_(window=None), dtype, device)    # a window holds no more than this
    need = full.sequence_bytes(num_tokens) + mode.sequence_bytes(num_tokens) + mode.block_bytes
    budget = engine.budget_mb * MIB
    if need > budget:
        raise ConfigError(f"the KV budget ({engine.budget_mb:g} MiB) cannot hold the measurement, which needs "
                          f"{need / MIB:.1f} MiB: raise the budget in Settings, then press Measure")


def count_tokens(tokenizer, system_prompt: str | None, turns) -> int:
    """Tokens the conversation takes in the cache: the chat template's rendering when the tokenizer has one."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
        [{"role": role, "content": content} for role, content in turns]
    template = getattr(tokenizer, "apply_chat_template", None)
    if template is not None and getattr(tokenizer, "chat_template", None):
        text = template(messages, tokenize=False, add_generation_prompt=False)
        return len(tokenizer.encode(text, add_special_tokens=False))
    return sum(len(tokenizer.encode(m["content"], add_special_tokens=False)) for m in messages)


def count_conversations(engine, requests) -> TokenCounts:
    """Runs in the engine thread: requests are (conversation id, system prompt, ((role, content), ...))."""
    counts = []
    for conversation_id, system_prompt, turns in requests:
        try:
            counts.append((conversation_id, count_tokens(engine.tokenizer, system_prompt, turns)))
        except Exception:  # noqa: BLE001 - a conversation the template refuses is left out of the histogram
            continue
    return TokenCounts(str(getattr(engine, "model_name", "")), tuple(counts))
