import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_engine():
    from engine import Engine, EngineConfig
    # dense fp32 weights: the path whose logits must match transformers exactly
    return Engine.load(EngineConfig(model="default", weights="dense"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from tiny_models import tiny_model_dir
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), arch="llama", hidden=96, heads=6, kv_heads=2,
                          layers=3, max_positions=4096)


@pytest.fixture(scope="session")
def tiny_engine(tiny_llama):
    from engine import Engine, EngineConfig
    return Engine.load(EngineConfig(model=tiny_llama))
