"""The prompt precision in the app (Settings › Model › Read prompts in): saved, applied to the engine live and to
each engine loaded later, and named in the status line and the dashboard while prompts are read in bf16; and decode
rows' activations (Settings › Model › Decode with) the same way. The real default model (packed weights: the
choices apply to them), a real window offscreen."""
from __future__ import annotations

import pytest
from PySide6.QtCore import QSettings

from kvchat.app.store.settings_store import SettingsStore
from kvchat.engine.config import SamplingParams
from fakes import engine_of, isolate_app, real_window
from kvchat.kernels import cpu_lib

pytestmark = pytest.mark.gui
SHORT = SamplingParams(temperature=0, max_new_tokens=8)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))


def said(window) -> bool:
    return "prompts in bf16" in window.status_label.text() and not window.dashboard.live.prompt_note.isHidden()


def test_the_choice_is_saved_switched_live_and_said(qtbot):
    window = real_window(qtbot, "default", sampling=SHORT)
    auto = cpu_lib.auto_prefill()[0]
    assert window.store.prefill() == "auto" and engine_of(window).prefill == auto
    assert said(window) == (auto == "bf16")
    dialog = window.open_settings()
    assert dialog.prefill() == "auto" and auto in dialog.prefill_combo.currentText()
    dialog.prefill_combo.setCurrentIndex(dialog.prefill_combo.findData("bf16"))
    dialog.accept()
    assert SettingsStore().prefill() == "bf16"
    qtbot.waitUntil(lambda: engine_of(window).prefill == "bf16" and said(window), timeout=5000)
    dialog = window.open_settings()
    assert dialog.prefill() == "bf16"
    dialog.prefill_combo.setCurrentIndex(dialog.prefill_combo.findData("fp32"))
    dialog.accept()
    qtbot.waitUntil(lambda: engine_of(window).prefill == "fp32" and not said(window), timeout=5000)
    assert SettingsStore().prefill() == "fp32"
    from kvchat.kernels import cpu_quant
    dialog = window.open_settings()
    dialog.prefill_combo.setCurrentIndex(dialog.prefill_combo.findData("int8"))
    dialog.accept()
    if cpu_quant.gemm8_available():     # int8 prompt rows: named as bf16's are
        qtbot.waitUntil(lambda: engine_of(window).prefill == "int8" and "prompts in int8" in window.status_label.text()
                        and "int8" in window.dashboard.live.prompt_note.text()
                        and not window.dashboard.live.prompt_note.isHidden(), timeout=5000)
    else:                               # where the build has none, the exact GEMM, said in the engine's reason
        qtbot.waitUntil(lambda: engine_of(window).prefill == "fp32", timeout=5000)
        assert "AVX2 or AVX-512" in engine_of(window).prefill_why


def test_a_saved_choice_reaches_a_newly_loaded_engine_and_a_damaged_one_reads_as_auto(qtbot, tmp_path):
    SettingsStore().set_prefill("bf16")
    window = real_window(qtbot, "default", sampling=SHORT)
    qtbot.waitUntil(lambda: engine_of(window).prefill == "bf16" and said(window), timeout=5000)
    raw = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    raw.setValue("engine/prefill", "int3")
    raw.sync()
    assert SettingsStore().prefill() == "auto"


def test_int8_decode_activations_are_saved_switched_live_and_said(qtbot, tmp_path):
    """Settings › Model › Decode with: int16 by default; int8 reaches the engine's kernels at once and is named in the
    status line; a later engine gets the saved choice; a damaged value reads as int16."""
    window = real_window(qtbot, "default", sampling=SHORT)
    assert window.store.activations() == "int16" and engine_of(window).activations == "int16"
    assert "int8 activations" not in window.status_label.text()
    dialog = window.open_settings()
    assert dialog.activations() == "int16"
    dialog.activations_combo.setCurrentIndex(dialog.activations_combo.findData("int8"))
    dialog.accept()
    assert SettingsStore().activations() == "int8"
    qtbot.waitUntil(lambda: engine_of(window).activations == "int8"
                    and "decoding with int8 activations" in window.status_label.text(), timeout=5000)
    assert engine_of(window).model.kernel_layers() is not None      # the one-call step took the switch too
    window.send("Hello")                # a reply decoded with int8 activations
    qtbot.waitUntil(lambda: not window.generating and len(window.chat.chat_messages()) == 2, timeout=60000)
    assert window.chat.chat_messages()[-1].text()
    dialog = window.open_settings()
    assert dialog.activations() == "int8"
    dialog.activations_combo.setCurrentIndex(dialog.activations_combo.findData("int16"))
    dialog.accept()
    qtbot.waitUntil(lambda: engine_of(window).activations == "int16"
                    and "int8 activations" not in window.status_label.text(), timeout=5000)
    raw = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    raw.setValue("engine/activations", "int4")
    raw.sync()
    assert SettingsStore().activations() == "int16"
