"""The quality line measures a window mode: it reads past the window and its sinks, so the window slides, or it
says the mode was not measured."""
from __future__ import annotations

import pytest

from kvchat.app.bridge.measure import measure
from kvchat.app.store.quality import QualityResult, covers
from kvchat.engine import CacheConfig
from kvchat.engine.config import ConfigError

FP32 = CacheConfig(k_format="fp32", v_format="fp32")


@pytest.fixture
def tiny_engine(tiny_engine):
    """The shared engine with room for a measurement (an earlier test may have left it a budget of 0.5 MiB)."""
    runner = tiny_engine.runner
    before = runner.budget_bytes / 2**20
    runner.set_budget(max(before, 64))
    yield tiny_engine
    runner.set_budget(before)


def test_a_full_precision_window_measures_what_the_window_drops(tiny_engine):
    """fp32 with a window of 256 + 4 is fp32 until the window slides: the measurement reads past it, and finds a
    cost (read only 256 tokens it would have said 100 % / KL 0, fp32's own figure)."""
    windowed = measure(tiny_engine, FP32.with_(window=256, sinks=4), num_tokens=64)
    assert windowed.tokens == 256 + 4 + 64
    assert windowed.mean_kl > 0.0 and windowed.top1_agreement < 1.0
    plain = measure(tiny_engine, FP32, num_tokens=windowed.tokens)
    assert plain.tokens == windowed.tokens and plain.mean_kl == pytest.approx(0.0, abs=1e-9)


def test_a_window_the_context_cannot_slide_is_not_measured(tiny_engine):
    """A window past the model's context (4,096 tokens here) never slides within it: no figure, a reason."""
    with pytest.raises(ConfigError, match="not measured"):
        measure(tiny_engine, FP32.with_(window=4080, sinks=4))


def test_a_stored_window_result_that_never_slid_is_not_shown():
    """An older version stored a window mode's figure from 256 tokens: it is not this mode's figure."""
    window = FP32.with_(window=256, sinks=4)
    assert not covers(window, QualityResult("m", "w", 1.0, 0.0, 256, 1.0))
    assert covers(window, QualityResult("m", "w", 0.9, 0.1, 516, 1.0))
    assert covers(FP32, QualityResult("m", "fp32", 1.0, 0.0, 256, 1.0))
