"""CacheConfig refuses impossible numbers; check_cache_for_model agrees with the engine's own allocation."""
from __future__ import annotations

import math

import pytest

from kvchat.cli.terminal import main as cli_main
from kvchat.engine.config import CacheConfig, ConfigError
from kvchat.engine.units import MIB
from kvchat.engine.kv.layout import check_cache_for_model, kv_layout


@pytest.mark.parametrize("changes, words", [
    (dict(budget_mb=math.inf), "finite"), (dict(budget_mb=math.nan), "finite"), (dict(budget_mb=-1.0), "positive"),
    (dict(budget_mb="64"), "MiB"), (dict(sinks=2.5), "whole number"), (dict(sinks="4"), "whole number"),
    (dict(window=300.5), "whole number"), (dict(window=True), "whole number"),
    (dict(full_precision_layers=("a",)), "layer numbers"), (dict(full_precision_layers=(1.5,)), "layer numbers"),
    (dict(full_precision_layers=3), "list of layer numbers"), (dict(block_size=16.0), "whole number"),
])
def test_cache_config_rejects_impossible_values(changes, words):
    """inf/nan budgets, fractional sinks and windows, non-numeric layers: a ConfigError naming the field."""
    with pytest.raises(ConfigError, match=words) as info:
        CacheConfig(**changes)
    assert next(iter(changes)) in str(info.value)


def test_check_cache_for_model_names_each_problem(tiny_engine):
    """Missing layers, a window + sinks past the context, a budget below one block: each one line."""
    mc = tiny_engine.model.config
    check_cache_for_model(CacheConfig(window=mc.max_position_embeddings - 4, sinks=4), mc)
    with pytest.raises(ConfigError, match="context of 4,096"):
        check_cache_for_model(CacheConfig(window=mc.max_position_embeddings - 3, sinks=4), mc)
    with pytest.raises(ConfigError, match=f"layers 3, 9 do not exist.*0-{mc.num_layers - 1}"):
        check_cache_for_model(CacheConfig(full_precision_layers=(0, 3, 9)), mc)
    with pytest.raises(ConfigError, match="does not hold even one block"):
        check_cache_for_model(CacheConfig(budget_mb=0.001), mc)


@pytest.mark.parametrize("cache", [
    CacheConfig(), CacheConfig(k_format="int8", v_format="int8"), CacheConfig(k_format="int4", v_format="int4"),
    CacheConfig(k_format="int4", v_format="fp8", k_scheme="token", full_precision_layers=(1,), block_size=32),
])
def test_budget_boundary_matches_the_engine(tiny_engine, cache):
    """The smallest budget check_cache_for_model accepts is the smallest the engine's cache opens with."""
    mc = tiny_engine.model.config
    layout = kv_layout(mc, cache, tiny_engine.dtype_name, str(tiny_engine.device))
    per_block, fixed = layout.block_bytes, layout.fixed_bytes
    enough = cache.with_(budget_mb=(per_block + fixed) / MIB)
    short = cache.with_(budget_mb=(per_block + fixed - 1) / MIB)
    check_cache_for_model(enough, mc, tiny_engine.dtype_name, str(tiny_engine.device))
    assert tiny_engine.new_session(cache=enough).stats().blocks_budget == 1
    with pytest.raises(ConfigError):
        check_cache_for_model(short, mc, tiny_engine.dtype_name, str(tiny_engine.device))
    with pytest.raises(ConfigError):
        tiny_engine.new_session(cache=short)


def test_cli_bad_fp_layers_is_one_line(capsys):
    """`kvchat chat --fp-layers a` prints one line saying what to give, and exits 2 without a traceback."""
    code = cli_main(["chat", "--fp-layers", "a", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "--fp-layers" in err and "0,1,29" in err and "Traceback" not in err
