"""The engine's refusals speak MiB and give advice that fits the state: no reset when nothing is held,
no smaller format than the one in use, shorten the message when the message alone is too big."""
import pytest

from kvchat.engine import BudgetFull, CacheConfig, Engine, EngineConfig
from kvchat.engine.kv.layout import MIB
from tiny_models import random_ids


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tiny_models import tiny_model_dir
    folder = tiny_model_dir(tmp_path_factory.mktemp("tiny-texts"), hidden=128, heads=4, kv_heads=2, head_dim=64,
                            layers=2, max_positions=256, seed=5)
    return Engine.load(EngineConfig(model=folder))


def _session(engine, fmt: str, blocks: int = 4):
    config = CacheConfig(k_format=fmt, v_format=fmt, overflow="stop")
    layout = engine.runner.layout(config)
    return engine.new_session(cache=config.with_(budget_mb=(blocks * layout.block_bytes + layout.fixed_bytes + 1) / MIB))


@pytest.mark.parametrize("fmt, smaller", [("auto", "int8 or int4"), ("int8", "int4"), ("fp8", "int4"), ("int4", None)])
def test_budget_advice_fits_the_state(engine, fmt, smaller):
    s = _session(engine, fmt)
    with pytest.raises(BudgetFull) as err:          # nothing held: the message alone is too big
        s.append(random_ids(engine, 100))
    empty = str(err.value)
    assert "MiB" in empty and "MB" not in empty.replace("MiB", "") and "budget_mb" not in empty
    assert "reset" not in empty and "shorten the message" in empty
    if smaller:
        assert f"smaller format ({smaller})" in empty
    else:
        assert "smaller format" not in empty, "nothing is smaller than int4"
    s.append(random_ids(engine, 40))
    with pytest.raises(BudgetFull) as err:          # something held: resetting it is worth saying
        s.append(random_ids(engine, 60, seed=1))
    assert "reset the session" in str(err.value) and "40 tokens are held" in str(err.value)


def test_context_advice_fits_the_state(engine):
    s = engine.new_session(cache=CacheConfig())
    events = list(s.send("word " * 400))
    assert events[-1].finish_reason == "context"
    assert "shorten the message" in events[-1].message and "context of 256 tokens" in events[-1].message
