"""Reset gives memory back: the page storage shrinks to what open chats hold, the allocator returns freed pages
to the system (malloc_trim on glibc), and the dashboard's RSS line shows the snapshot taken after it."""
from __future__ import annotations

import os

import psutil
import pytest

from kvchat.engine import CacheConfig, SamplingParams
from kvchat.engine.plan.fit import trim_heap
from fakes import isolate_app

MIB = 2**20


@pytest.fixture
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)


@pytest.mark.gui
def test_reset_in_the_app_empties_the_page_storage_and_the_dashboard_shows_the_memory_after(
        qtbot, tiny_llama, _isolated):
    """Reset in the app also drops the blocks kept for prefix reuse (they held the page storage at its peak);
    the snapshot that ResetDone carries, probed after the memory went back, is the RSS line's newest point."""
    from test_app_engine import real_window, send

    window = real_window(qtbot, tiny_llama, cache=CacheConfig(k_format="fp32", v_format="fp32"))
    send(qtbot, window, "The quick brown fox jumps over the lazy dog. " * 12)
    before = window.dashboard.data.latest
    assert before.pool.storage_bytes > 0 and before.kv_bytes > 0
    with qtbot.waitSignal(window.host.reset_done, timeout=10_000) as blocker:
        window.reset_session()
    after = blocker.args[0].stats
    assert after.kv_bytes == 0 and after.pool.evictable_blocks == 0 and after.pool.storage_bytes == 0
    assert after.time_s > before.time_s
    assert window.dashboard.data.latest is after
    assert window.dashboard.data.series["rss"][-1] == after.memory.rss_bytes
    assert send(qtbot, window, "Still there?").finish_reason in ("length", "eos")


def test_clear_prefix_cache_shrinks_the_page_storage(tiny_engine):
    """session.reset keeps full blocks for prefix reuse (the storage stays); clear_prefix_cache lets it go."""
    for seq in list(tiny_engine.runner.cache.sequences()):
        tiny_engine.runner.close(seq)
    s = tiny_engine.new_session(cache=CacheConfig(k_format="fp32", v_format="fp32"))
    s.reply("The quick brown fox jumps over the lazy dog. " * 12, SamplingParams(temperature=0.0, max_new_tokens=4))
    held = tiny_engine.runner.storage_bytes()
    s.reset()
    assert tiny_engine.runner.cache._blocks.pool.num_evictable > 0 and tiny_engine.runner.storage_bytes() == held
    assert tiny_engine.clear_prefix_cache() > 0
    assert tiny_engine.runner.storage_bytes() == 0 and tiny_engine.runner.cache._blocks.held_bytes == 0


def _rss_mib() -> float:
    return psutil.Process(os.getpid()).memory_info().rss / MIB


@pytest.mark.slow
def test_reset_gives_most_of_a_long_chats_memory_back_to_the_system():
    """The real default model as the app loads it: RSS at load, after a long chat, and after Reset (the session's
    reset and the prefix cache cleared, as the app's Reset does). Most of the growth must come back."""
    from pathlib import Path

    from kvchat.engine import Engine, EngineConfig

    engine = Engine.load(EngineConfig(model="default"))
    trim_heap()
    at_load = _rss_mib()
    text = (Path(__file__).resolve().parents[1] / "resources" / "texts" / "prose.txt").read_text()
    session = engine.new_session()
    for i in range(3):
        part = text[i * 6000:(i + 1) * 6000]
        done = list(session.send(f"{part}\n\nSummarize this in one line.",
                                 SamplingParams(temperature=0.0, max_new_tokens=24)))[-1]
        assert done.finish_reason in ("eos", "length"), done.message
    assert session.seq.num_tokens > 3000
    after_chat, tokens = _rss_mib(), session.seq.num_tokens
    session.reset()
    engine.clear_prefix_cache()
    after_reset = _rss_mib()
    print(f"RSS at load {at_load:.0f} MiB, after a {tokens}-token chat {after_chat:.0f} MiB, "
          f"after reset {after_reset:.0f} MiB")
    growth = after_chat - at_load
    assert growth > 40, f"the chat grew RSS by {growth:.0f} MiB only: not a long chat"
    assert after_reset - at_load < 0.35 * growth, (at_load, after_chat, after_reset)
    assert engine.runner.storage_bytes() == 0


class _FakeNVML:
    """pynvml as the driver would answer for this process: used = a base (CUDA context, weights) plus the page
    storage the engine's pool holds now. Stands in for a GPU only because this machine has none."""

    def __init__(self, runner, base: int = 300 * MIB, total: int = 12 * 1024 * MIB):
        self.runner, self.base, self.total = runner, base, total

    def nvmlDeviceGetMemoryInfo(self, handle):
        from types import SimpleNamespace
        return SimpleNamespace(total=self.total, used=self.base + self.runner.storage_bytes())

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        from types import SimpleNamespace
        return [SimpleNamespace(pid=os.getpid(), usedGpuMemory=self.base + self.runner.storage_bytes())]


@pytest.mark.gui
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a real GPU is here: NVML is not mocked")
def test_on_a_gpu_the_dashboard_shows_nvml_and_the_allocator_and_reset_drops_them(qtbot, tiny_llama, _isolated,
                                                                                   monkeypatch):
    """Weights, KV pool, torch's allocator and NVML side by side; Reset returns the pages (the allocator's figure and
    NVML's drop in the snapshot ResetDone carries, and the dashboard's lines show it)."""
    import sys
    from kvchat.engine.runtime import memory
    from test_app_engine import real_window, send

    window = real_window(qtbot, tiny_llama, cache=CacheConfig(k_format="fp32", v_format="fp32"))
    runner = window.host.worker._session.runner
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNVML(runner))
    monkeypatch.setattr(memory, "_nvml", lambda: "gpu0")
    monkeypatch.setattr(memory, "_allocated", lambda: runner.storage_bytes() + 50 * MIB)
    send(qtbot, window, "The quick brown fox jumps over the lazy dog. " * 12)
    before = window.dashboard.data.latest
    assert before.memory.gpu_used_bytes > 300 * MIB and before.memory.gpu_total_bytes == 12 * 1024 * MIB
    assert before.memory.torch_allocated_bytes > 50 * MIB
    assert {"weights", "torch", "gpu", "kv"} <= set(window.dashboard.live.applicable_series())   # side by side
    with qtbot.waitSignal(window.host.reset_done, timeout=10_000) as blocker:
        window.reset_session()
    after = blocker.args[0].stats
    assert after.memory.gpu_used_bytes == 300 * MIB < before.memory.gpu_used_bytes
    assert after.memory.torch_allocated_bytes == 50 * MIB
    series = window.dashboard.data.series
    assert series["gpu"][-1] == 300 * MIB and max(series["gpu"]) > 300 * MIB
    assert series["torch"][-1] == 50 * MIB
