"""Issue 37 item 21: LongRoPE (Phi-3 / Phi-4-mini) takes its long factors when the cache's context passes the
original one, as transformers does past original_max_position_embeddings (llama.cpp: by its context size), and says
which (Engine.rope_note, `kvchat doctor --model`).

The tiny Phi-3 of tests/tiny_models.py: an original context of 64 positions, 256 in all. A budget that holds more
than 64 tokens takes the long factors: a 96-token prompt gives transformers' logits. One that holds 64 at most, or a
window of 64 at most, keeps the short ones: a 48-token prompt gives transformers' logits."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvchat.engine import CacheConfig, Engine, EngineConfig
from kvchat.engine.model.config import ModelConfig
from kvchat.engine.model.source import locate, read_config, transformers_reference
from tiny_models import tiny_family_dir

FP32 = CacheConfig(k_format="fp32", v_format="fp32")
# 2 layers x 2 kv heads x 16 dims x (K, V) x 4 bytes: 512 B a token, 8 KiB a block of 16
HOLDS_64 = FP32.with_(budget_mb=4 * 8 / 1024)


@pytest.fixture(scope="module")
def phi(tmp_path_factory):
    return tiny_family_dir(tmp_path_factory.mktemp("phi") / "phi3", "phi3", longrope=True)


def transformers_logits(folder: str, ids: list[int]) -> torch.Tensor:
    ref = transformers_reference(locate(folder), torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def engine_logits(folder: str, cache: CacheConfig, ids: list[int]) -> tuple[torch.Tensor, Engine]:
    engine = Engine.load(EngineConfig(model=folder, weights="dense", cache=cache))
    return engine.new_session().append(ids, all_logits=True), engine


@pytest.mark.parametrize("cache, length, factors", [(FP32, 96, "long"), (HOLDS_64, 48, "short"),
                                                     (FP32.with_(window=48, sinks=16), 48, "short")])
def test_the_factors_follow_the_caches_context_and_match_transformers(phi, cache, length, factors):
    ids = torch.randint(3, 320, (length,), generator=torch.Generator().manual_seed(1)).tolist()
    ours, engine = engine_logits(phi, cache, ids)
    theirs = transformers_logits(phi, ids)
    assert (ours - theirs).abs().max() <= 1e-3 * theirs.abs().max()
    assert engine.rope_note.startswith(f"LongRoPE {factors} factors: a context of ")
    rope = read_config(Path(phi))["rope_parameters"]
    assert all(layer.rope.scaling == ("factors", tuple(rope[f"{factors}_factor"]))
               for layer in engine.model.config.layers)


def test_the_choice_is_by_the_original_context_and_goes_both_ways(phi):
    mc = ModelConfig.from_hf(read_config(Path(phi)))
    long = mc.for_context(65)
    assert mc.for_context(64) == mc and long != mc and long.for_context(64) == mc and long.for_context(256) == long
    assert long.rope_note(65) == "LongRoPE long factors: a context of 65 tokens, past the original 64"


def test_other_ropes_have_no_note(tiny_engine):
    assert tiny_engine.rope_note is None


def test_kvchat_doctor_says_which_factors_the_cache_options_take(phi, tiny_llama):
    from kvchat.cli import doctor
    from kvchat.cli.terminal import build_parser

    def rope(model, *options):
        return doctor.rope(build_parser(benches=False).parse_args(["doctor", "--model", model, *options]))
    assert rope(phi) == "LongRoPE long factors: a context of 256 tokens, past the original 64"
    assert rope(phi, "--budget-mb", "0.03125", "--k-format", "fp32", "--v-format", "fp32") == \
        "LongRoPE short factors: a context of 64 tokens, within the original 64"
    assert rope(phi, "--window", "32") == "LongRoPE short factors: a context of 36 tokens, within the original 64"
    assert rope(tiny_llama).startswith("one set of rotary frequencies at every length")


def test_a_cache_saved_with_the_other_factors_is_refused(phi, tmp_path):
    """Keys rotated with the long factors are not read back by an engine that took the short ones."""
    from kvchat.engine.runtime.warm import CacheFileError, WarmStore
    engines = [Engine.load(EngineConfig(model=phi, cache=cache)) for cache in (FP32, HOLDS_64)]
    sessions = []
    for engine in engines:
        engine._warm_store = WarmStore(tmp_path / "kv")
        sessions.append(engine.new_session())
        engine.keep_warm(sessions[-1], "c")
    sessions[0].append(list(range(3, 35)))
    assert engines[0].save_warm(sessions[0]) > 0
    with pytest.raises(CacheFileError, match="with the model's other LongRoPE factors"):
        engines[1].restore_warm(sessions[1])
    again = engines[0].new_session()
    engines[0].keep_warm(again, "c")
    assert engines[0].restore_warm(again).tokens == 32
