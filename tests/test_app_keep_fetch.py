"""Settings' Keep what matters (CacheConfig.eviction) and Fetch what is needed (CacheConfig.retrieval_blocks): what
the controls build, how they exclude each other and the window, what a refused combination says, and how the
settings file keeps them. No model is loaded."""
from __future__ import annotations

import json
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from PySide6.QtWidgets import QDialogButtonBox

from kvchat.app.dialogs.settings_dialog import PRESETS, SettingsDialog, key_summary_share
from kvchat.app.store.history import cache_to_json
from kvchat.app.store.settings_store import AppSettings, SettingsStore
from kvchat.engine.config import CacheConfig
from fakes import isolate_app

pytestmark = pytest.mark.gui


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)


def dialog_for(qtbot, cache: CacheConfig | None = None) -> SettingsDialog:
    dialog = SettingsDialog(AppSettings(cache=cache or CacheConfig()))
    qtbot.addWidget(dialog)
    return dialog


def ok_enabled(dialog) -> bool:
    return dialog.buttons.button(QDialogButtonBox.StandardButton.Ok).isEnabled()


def cache_of(dialog) -> CacheConfig:
    settings = dialog.result_settings()
    assert settings is not None, dialog.error_label.text()
    return settings.cache


def test_keep_what_matters_maps_to_eviction_and_needs_a_window(qtbot):
    dialog = dialog_for(qtbot)
    assert not dialog.keep_important.isEnabled()             # no window yet
    assert cache_of(dialog).eviction == "window"
    dialog.window.setValue(256)
    assert dialog.keep_important.isEnabled()
    dialog.keep_important.setChecked(True)
    cache = cache_of(dialog)
    assert (cache.eviction, cache.window, cache.retrieval_blocks) == ("importance", 256, None)
    assert "by attention" in cache.label()
    dialog.keep_important.setChecked(False)
    assert cache_of(dialog).eviction == "window"
    dialog.keep_important.setChecked(True)
    dialog.window.setValue(0)                                # the tick stays, unused, while there is no window
    assert not dialog.keep_important.isEnabled() and ok_enabled(dialog)
    assert cache_of(dialog).eviction == "window" and cache_of(dialog).window is None
    assert "Drops the least-attended blocks" in dialog.keep_cost.text()


def test_fetch_what_is_needed_maps_to_retrieval_blocks(qtbot):
    dialog = dialog_for(qtbot)
    assert dialog.fetch_blocks.isEnabled() and (dialog.fetch_blocks.minimum(), dialog.fetch_blocks.maximum()) == (0, 4096)
    assert cache_of(dialog).retrieval_blocks is None
    dialog.fetch_blocks.setValue(8)
    cache = cache_of(dialog)
    assert (cache.retrieval_blocks, cache.window, cache.eviction) == (8, None, "window")
    assert "reading 8 blocks a token" in cache.label()
    dialog.fetch_blocks.setValue(0)
    assert cache_of(dialog).retrieval_blocks is None
    assert "6% more memory" in dialog.fetch_cost.text()      # bf16 max and min per key channel, 16-token blocks
    dialog.k_format.setCurrentIndex(dialog.k_format.findData("int4"))
    dialog.v_format.setCurrentIndex(dialog.v_format.findData("int4"))
    assert "25% more memory" in dialog.fetch_cost.text()


def test_window_and_fetch_exclude_each_other(qtbot):
    dialog = dialog_for(qtbot)
    dialog.fetch_blocks.setValue(16)
    assert not dialog.window.isEnabled() and dialog.fetch_blocks.isEnabled()
    dialog.fetch_blocks.setValue(0)
    assert dialog.window.isEnabled()
    dialog.window.setValue(512)
    assert not dialog.fetch_blocks.isEnabled() and dialog.fetch_blocks.value() == 0
    dialog.fetch_blocks.setValue(8)                          # set from code while a window is set: the window wins
    assert dialog.fetch_blocks.value() == 0 and cache_of(dialog).window == 512
    dialog.window.setValue(0)
    dialog.fetch_blocks.setValue(8)
    dialog.window.setValue(256)                              # a window set from code (a preset) turns Fetch off
    cache = cache_of(dialog)
    assert (cache.window, cache.retrieval_blocks) == (256, None) and dialog.fetch_blocks.value() == 0


def test_a_refused_combination_is_explained_in_the_dialog(qtbot):
    dialog = dialog_for(qtbot)
    dialog.window.setValue(32)                               # a window of two blocks: too small to choose in
    dialog.keep_important.setChecked(True)
    assert not ok_enabled(dialog) and dialog.result_settings() is None
    assert "at least 48 tokens" in dialog.error_label.text() and dialog.error_label.isVisibleTo(dialog)
    dialog.window.setValue(48)
    assert ok_enabled(dialog) and cache_of(dialog).eviction == "importance"
    dialog.sinks.setValue(20)                                # two sink blocks now
    assert not ok_enabled(dialog) and "at least 64 tokens" in dialog.error_label.text()
    dialog.keep_important.setChecked(False)
    assert ok_enabled(dialog)
    dialog.window.setValue(0)
    dialog.fetch_blocks.setValue(4)
    dialog.overflow.setCurrentIndex(dialog.overflow.findData("slide"))
    assert not ok_enabled(dialog) and "Fetch what is needed keeps every block" in dialog.error_label.text()
    dialog.overflow.setCurrentIndex(dialog.overflow.findData("stop"))
    assert ok_enabled(dialog) and cache_of(dialog).retrieval_blocks == 4


def test_presets_leave_keep_and_fetch_at_their_defaults(qtbot):
    dialog = dialog_for(qtbot, CacheConfig(window=512, eviction="importance"))
    assert dialog.keep_important.isChecked() and dialog.keep_important.isEnabled()
    names = list(PRESETS)
    dialog._apply_preset(1 + names.index("Window 256 + 4 sinks"))
    cache = cache_of(dialog)
    assert (cache.window, cache.eviction, cache.retrieval_blocks) == (256, "window", None)
    dialog.window.setValue(0)
    dialog.fetch_blocks.setValue(32)
    dialog._apply_preset(1 + names.index("int8 K and V"))
    cache = cache_of(dialog)
    assert (cache.k_format, cache.window, cache.retrieval_blocks) == ("int8", None, None)
    assert dialog.window.isEnabled()


def test_stored_choices_round_trip_and_reopen_in_the_dialog(qtbot):
    store = SettingsStore()
    kept = CacheConfig(k_format="int8", v_format="int8", window=1024, sinks=8, eviction="importance")
    store.save(AppSettings(cache=kept))
    assert SettingsStore().load().cache == kept
    fetched = CacheConfig(retrieval_blocks=64, block_size=32)
    store.save(AppSettings(cache=fetched))
    loaded = SettingsStore().load().cache
    assert loaded == fetched
    dialog = dialog_for(qtbot, loaded)
    assert dialog.fetch_blocks.value() == 64 and not dialog.window.isEnabled()
    assert cache_of(dialog) == fetched


def write_cache(store: SettingsStore, fields: dict) -> None:
    store._qs.setValue("engine/cache", json.dumps(fields))
    store.sync()


def test_old_damaged_or_impossible_stored_values_fall_back(qtbot):
    store = SettingsStore()
    base = json.loads(cache_to_json(CacheConfig(window=512, sinks=4, k_format="int8", v_format="int8")))
    old = {k: v for k, v in base.items() if k not in ("eviction", "retrieval_blocks")}    # a file from before them
    write_cache(store, old)
    cache = SettingsStore().load().cache
    assert (cache.window, cache.k_format, cache.eviction, cache.retrieval_blocks) == (512, "int8", "window", None)
    for garbage in ({"eviction": "everything"}, {"eviction": 7}, {"retrieval_blocks": "many"},
                    {"retrieval_blocks": -3}, {"retrieval_blocks": 2.5}, {"retrieval_blocks": True},
                    {"retrieval_blocks": 16},                                   # beside a window: impossible
                    {"eviction": "importance", "window": 20, "block_size": 16},  # too small a window to choose in
                    {"eviction": [], "retrieval_blocks": {}}):
        write_cache(store, {**base, **garbage})
        cache = SettingsStore().load().cache                 # no exception, the rest of the cache kept
        assert cache.k_format == "int8" and cache.retrieval_blocks is None, garbage
        assert cache.window == garbage.get("window", 512) and cache.eviction == "window", garbage
    write_cache(store, {**base, "window": None, "eviction": "importance", "retrieval_blocks": 8})
    cache = SettingsStore().load().cache                     # importance without a window: Fetch alone is kept
    assert (cache.window, cache.eviction, cache.retrieval_blocks) == (None, "window", 8)
    write_cache(store, {**base, "eviction": "importance", "retrieval_blocks": 8})
    cache = SettingsStore().load().cache                     # both beside a window: Fetch goes, Keep stays
    assert (cache.window, cache.eviction, cache.retrieval_blocks) == (512, "importance", None)
    for broken in ("{not json", "[1, 2]", "[" * 100_000, json.dumps({**base, "budget_mb": -1})):
        store._qs.setValue("engine/cache", broken)
        store.sync()
        assert SettingsStore().load().cache == CacheConfig(), broken[:20]
    dialog = dialog_for(qtbot, SettingsStore().load().cache)
    assert ok_enabled(dialog)


def test_key_summary_share_estimate():
    """The Fetch cost line's share: a bf16 max and min per key channel per block, against the block's K and V."""
    assert key_summary_share("auto", "auto", 16) == pytest.approx(1 / 16)        # auto is 16-bit on the CPU
    assert key_summary_share("fp32", "fp32", 16) == pytest.approx(1 / 32)
    assert key_summary_share("int8", "int8", 32) == pytest.approx(1 / 16)
    assert key_summary_share("auto", "auto", 16, "fp32", "cuda") == pytest.approx(1 / 32)


def test_the_gauge_gives_retrieval_a_line_of_its_own(qtbot):
    """What a token read, the summaries and the blocks on disk go on a second line (the first would cut them off in a
    narrow dock), and the gauge grows by that line only while there is one; the tooltip says what each means."""
    from kvchat.app.dashboard.dashboard_data import TokenRoom
    from kvchat.app.dashboard.gauge import TokenGauge
    gauge = TokenGauge()
    qtbot.addWidget(gauge)
    room = TokenRoom(450, 7742, "context", 8192, 0.06)
    gauge.set_room(room)
    one = gauge.sizeHint().height()
    assert gauge.lines()[1] == ""
    gauge.set_room(room, 0, (9, 29, 5760), (12, 40, 7))
    main, detail = gauge.lines()
    assert "450 tokens in cache" in main and "context binds" in main and "evicted" not in main
    assert "reads 9 of 29 blocks" in detail and "12 on disk, 40 fetched, 7 hits" in detail
    assert gauge.sizeHint().height() == one + gauge.fontMetrics().height()
    assert "Blocks on disk past the budget: 12" in gauge.toolTip() and "min and max keys" in gauge.toolTip()
