"""The KV budget: stop with a message and an intact chat, slide into a window, the tokens_left forecast."""
import pytest
import torch

from kvchat.engine import BudgetFull, CacheConfig, Engine, EngineConfig, SamplingParams
from kvchat.engine.events import TurnFinished
from kvchat.engine.kv.layout import MIB
from tiny_models import random_ids as _ids


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tiny_models import tiny_model_dir
    folder = tiny_model_dir(tmp_path_factory.mktemp("tiny-budget"), hidden=128, heads=4, kv_heads=2, head_dim=64,
                            layers=2, max_positions=2048, seed=4)
    return Engine.load(EngineConfig(model=folder))


def _budget_for(engine, config: CacheConfig, blocks: int) -> float:
    """A budget in MiB that holds exactly `blocks` blocks (plus the tails) in this mode."""
    layout = engine.runner.layout(config)
    return (blocks * layout.block_bytes + layout.fixed_bytes + 1) / MIB


@pytest.mark.parametrize("fmt", ["auto", "int8", "int4"])
def test_stop_refuses_the_turn_keeps_the_chat_and_never_passes_the_budget(engine, fmt):
    """overflow=stop: BudgetFull says how many tokens fit and what to do; the chat stays usable."""
    config = CacheConfig(k_format=fmt, v_format=fmt, overflow="stop")
    config = config.with_(budget_mb=_budget_for(engine, config, 6))
    s = engine.new_session(cache=config)
    budget = config.budget_mb * MIB
    s.append(_ids(engine, 70))
    assert s.stats().kv_bytes <= budget
    before_ids, before_bytes = list(s.token_ids), s.stats().kv_bytes
    left = s.tokens_left()
    assert left == 6 * 16 - 70
    with pytest.raises(BudgetFull) as err:
        s.append(_ids(engine, 40, seed=1))
    message = str(err.value)
    assert f"only {left} fit" in message
    assert "reset the session" in message.lower() and "sliding window" in message
    assert ("smaller format" in message) == (fmt != "int4")     # advice that fits: nothing is smaller than int4
    assert s.token_ids == before_ids and s.seq.num_tokens == 70 and s.stats().kv_bytes == before_bytes
    logits = s.append(_ids(engine, left, seed=2))               # exactly what fits still goes in
    assert logits.shape[0] == left and torch.isfinite(logits).all()
    assert s.stats().kv_bytes <= budget and s.tokens_left() == 0


def test_stop_in_a_chat_turn_finishes_with_budget_reason(engine):
    """A turn whose prompt cannot fit ends with finish_reason 'budget', the message, and no lost messages."""
    config = CacheConfig(overflow="stop")
    s = engine.new_session(cache=config.with_(budget_mb=_budget_for(engine, config, 4)))
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    s.reply("hi", params)
    messages = [dict(m) for m in s.messages]
    events = list(s.send("tell me everything " * 30, params))
    last = events[-1]
    assert isinstance(last, TurnFinished) and last.finish_reason == "budget"
    assert "fit" in last.message and "reset the session" in last.message
    assert s.messages == messages
    assert last.stats.kv_bytes <= last.stats.budget_bytes
    s.set_cache(s.cache_config.with_(window=16, sinks=4))       # the advice works: a window that fits takes the turn
    assert list(s.send("tell me everything " * 30, params))[-1].finish_reason == "length"


@pytest.mark.parametrize("fmt", ["auto", "int4"])
def test_slide_switches_to_a_window_and_goes_on(engine, fmt):
    """overflow=slide: past the budget the session becomes a window and keeps taking tokens within budget."""
    config = CacheConfig(k_format=fmt, v_format=fmt, overflow="slide")
    config = config.with_(budget_mb=_budget_for(engine, config, 8))
    s = engine.new_session(cache=config)
    budget = config.budget_mb * MIB
    ids = _ids(engine, 600, seed=3)
    for i in range(0, 600, 20):
        logits = s.append(ids[i:i + 20])
        assert torch.isfinite(logits).all()
        assert s.stats().kv_bytes <= budget
    assert s.cache_config.window is not None and s.cache_config.k_format == fmt
    assert s.seq.num_tokens == 600 and s.stats().tokens_evicted > 400


def test_slide_takes_a_long_prompt_in_one_append(engine):
    """A single append far past the budget slides instead of failing."""
    config = CacheConfig(overflow="slide")
    s = engine.new_session(cache=config.with_(budget_mb=_budget_for(engine, config, 10)))
    s.append(_ids(engine, 1500, seed=4))
    assert s.cache_config.window is not None
    assert s.stats().kv_bytes <= s.stats().budget_bytes


@pytest.mark.parametrize("fmt", ["auto", "fp16", "int8", "fp8", "int4"])
def test_tokens_left_is_right_within_one_block(engine, fmt):
    """Filling the budget: tokens_left tokens fit, one block more does not, from any starting fill."""
    config = CacheConfig(k_format=fmt, v_format=fmt, budget_mb=0.5)
    for start in (0, 7, 16, 50):
        s = engine.new_session(cache=config)
        if start:
            s.append(_ids(engine, start))
        left = s.tokens_left()
        assert left > 0
        with pytest.raises(BudgetFull):
            s.append(_ids(engine, left + 16, seed=5))
        s.append(_ids(engine, left, seed=6))
        assert s.tokens_left() == 0
        assert s.stats().kv_bytes <= 0.5 * MIB
        with pytest.raises(BudgetFull):
            s.append([1])


def test_tokens_left_follows_the_mode(engine):
    """Switching to a smaller format raises the forecast; a window makes it unbounded (None)."""
    s = engine.new_session(cache=CacheConfig(budget_mb=0.5))
    s.append(_ids(engine, 40))
    full = s.tokens_left()
    s.set_cache(CacheConfig(k_format="int8", v_format="int8", budget_mb=0.5))
    int8 = s.tokens_left()
    s.set_cache(CacheConfig(k_format="int4", v_format="int4", budget_mb=0.5))
    int4 = s.tokens_left()
    assert full < int8 < int4
    s.set_cache(CacheConfig(window=64, budget_mb=0.5))
    assert s.stats().tokens_left is None
