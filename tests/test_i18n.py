"""The Chinese interface: every string the app shows is in resources/i18n/kvchat_zh_CN.ts, translated, and the
committed .qm is what pyside6-lrelease makes of that .ts; with the zh_CN catalog installed, the window, its
dashboard pages and its dialogs show no English prose."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

from fakes import FakeLoader, isolate_app, open_window

ROOT = Path(__file__).resolve().parent.parent
TS = ROOT / "resources" / "i18n" / "kvchat_zh_CN.ts"
QM = ROOT / "resources" / "i18n" / "kvchat_zh_CN.qm"


def qt_tool(name: str) -> str:
    """pyside6-lupdate / pyside6-lrelease: beside this Python (a venv), else on PATH. PySide6 ships both."""
    here = Path(sys.executable).parent / f"pyside6-{name}"
    found = str(here) if here.is_file() else shutil.which(f"pyside6-{name}")
    assert found, f"pyside6-{name} not found: it comes with PySide6 (pip install PySide6-Essentials)"
    return found


def messages(ts: Path) -> dict[tuple[str, str], ET.Element]:
    """(context, source) -> its <translation> element."""
    root = ET.parse(ts).getroot()
    return {(context.findtext("name"), message.findtext("source")): message.find("translation")
            for context in root.iter("context") for message in context.iter("message")}


def app_sources() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "app").rglob("*.py"))


def test_every_source_string_is_in_the_ts_and_translated(tmp_path):
    """lupdate run over app/ now must find nothing the committed .ts lacks, and nothing it keeps is stale."""
    fresh = tmp_path / "fresh.ts"
    run = subprocess.run([qt_tool("lupdate"), *app_sources(), "-ts", str(fresh), "-locations", "none"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    in_code, committed = set(messages(fresh)), messages(TS)
    assert len(in_code) > 300                     # lupdate really read the app
    missing = sorted(in_code - set(committed))
    assert not missing, (f"{len(missing)} user-visible string(s) are not in {TS.name}; run `make translations` "
                         f"and translate them: {missing[:10]}")
    unfinished = sorted(key for key, tr in committed.items()
                        if key in in_code and (tr.get("type") in ("unfinished", "vanished", "obsolete")
                                               or not (tr.text or "").strip()))
    assert not unfinished, f"{len(unfinished)} string(s) have no Chinese translation yet: {unfinished[:10]}"
    stale = sorted(set(committed) - in_code)
    assert not stale, f"{TS.name} keeps strings the code no longer has (run `make translations`): {stale[:10]}"


def test_translations_keep_every_placeholder():
    """A translation names the same {fields} and line breaks as its source, so .format() fills it the same way."""
    fields = re.compile(r"\{\w*\}")
    for (context, source), translation in messages(TS).items():
        text = translation.text or ""
        assert sorted(fields.findall(text)) == sorted(fields.findall(source)), (context, source, text)
        assert text.count("\n") == source.count("\n"), (context, source, text)
        assert text.count("%") == source.count("%"), (context, source, text)
        assert text.count("<b>") == source.count("<b>"), (context, source, text)


def test_committed_qm_translates_every_message_as_the_ts_says(tmp_path):
    """The .qm in the repo (what `pip install .` ships and the app loads) is up to date with the .ts: every
    message translates to the .ts's text. Compared through QTranslator, not byte for byte, so another
    lrelease version writing the same catalog differently does not fail it; lrelease itself must still
    accept the .ts."""
    from PySide6.QtCore import QTranslator
    run = subprocess.run([qt_tool("lrelease"), str(TS), "-qm", str(tmp_path / "built.qm")], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    committed = QTranslator()
    assert committed.load(str(QM))
    wrong = [(context, source) for (context, source), translation in messages(TS).items()
             if committed.translate(context, source) != (translation.text or "")]
    assert not wrong, f"resources/i18n/kvchat_zh_CN.qm is stale ({len(wrong)} messages): run `make translations`"


def test_language_choice_resolves_system_locale_and_override(monkeypatch):
    from PySide6.QtCore import QLocale

    from kvchat.app.i18n import resolve
    assert resolve("system", QLocale(QLocale.Language.Chinese, QLocale.Country.China)) == "zh_CN"
    assert resolve("system", QLocale(QLocale.Language.Chinese, QLocale.Country.Taiwan)) == "zh_CN"
    assert resolve("system", QLocale(QLocale.Language.German, QLocale.Country.Germany)) == "en"
    assert resolve("en", QLocale(QLocale.Language.Chinese, QLocale.Country.China)) == "en"
    assert resolve("zh_CN") == resolve("zh-CN") == "zh_CN"
    assert resolve("klingon") == "en"


def test_language_is_saved_and_offered_in_settings(qtbot, monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)
    from kvchat.app.dialogs.settings_dialog import SettingsDialog
    from kvchat.app.store.settings_store import AppSettings, SettingsStore
    store = SettingsStore()
    assert store.language() == "system"
    dialog = SettingsDialog(AppSettings(), language="zh_CN")
    qtbot.addWidget(dialog)
    assert dialog.language() == "zh_CN"
    assert [dialog.language_choice.itemData(i) for i in range(dialog.language_choice.count())] == \
        ["system", "en", "zh_CN"]
    dialog.language_choice.setCurrentIndex(1)
    store.set_language(dialog.language())
    assert SettingsStore().language() == "en"
    store.set_language("nonsense")
    assert SettingsStore().language() == "system"


# --- the runtime check: the Chinese window shows no English prose ---

# words that stay as they are in Chinese: units, formats, product and model names, protocol words, values
# the engine takes literally (its format, scheme and overflow names), and the fake model's own name
ALLOWED = {
    "kv", "tok", "token", "tokens", "mib", "kib", "gib", "ttft", "rss", "torch", "gpu", "nvml", "url", "api",
    "gguf", "int", "fp", "bf", "top", "markdown", "json", "readme", "kvchat", "smollm", "instruct",
    "hugging", "face", "lm", "studio", "jan", "ollama", "apache", "gnu", "gpl", "lgpl", "fdl", "debian", "pypi",
    "llm", "vllm", "sglang", "llama", "cpp", "serve", "openai", "config", "safetensors", "default",
    "nats", "kl", "psutil", "pynvml", "metrics", "http", "models", "english", "cpu", "fake",
    "model", "common", "licenses", "usr", "share", "texts", "resources", "gguf", "q", "ctrl", "shift", "esc",
    "return", "v", "k", "s", "ms", "b", "ok", "chmod", "w", "get", "file", "nbsp", "amx", "avx", "vnni",
}
WORD = re.compile(r"[A-Za-z]+")


def english_words(text: str) -> list[str]:
    text = re.sub(r"<[^>]+>", " ", text or "")                 # markup
    text = re.sub(r"https?://\S+|/\S+|\S+\.(gguf|json|md|py)\b", " ", text)   # addresses and paths
    return [w for w in WORD.findall(text) if w.lower() not in ALLOWED and len(w) > 1]


def visible_texts(root) -> list[tuple[str, str]]:
    """(where, text) for every text a user can see or hover in `root` and below."""
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import (QAbstractButton, QAbstractSpinBox, QComboBox, QDockWidget, QGroupBox, QLabel,
                                   QLineEdit, QMenu, QPlainTextEdit, QTabBar, QTableView, QWidget)
    user_content = {"messageText", "codeBody", "messageAuthor", "chatInput", "codeLanguage"}
    out = []
    widgets = [root] + root.findChildren(QWidget)
    for w in widgets:
        name = f"{type(w).__name__}#{w.objectName()}"
        if w.objectName() in user_content:
            continue
        out.append((f"{name} tooltip", w.toolTip()))
        if w.isWindow() or isinstance(w, QDockWidget):
            out.append((f"{name} title", w.windowTitle()))
        if isinstance(w, QLabel):
            out.append((name, w.text()))
        elif isinstance(w, QAbstractButton):
            out.append((name, w.text()))
        elif isinstance(w, QGroupBox):
            out.append((name, w.title()))
        elif isinstance(w, (QLineEdit, QPlainTextEdit)):
            out.append((f"{name} placeholder", w.placeholderText()))
        elif isinstance(w, QAbstractSpinBox):
            out.append((f"{name} special", w.specialValueText()))
        elif isinstance(w, QComboBox):
            out += [(f"{name} item", w.itemText(i)) for i in range(w.count())]
        elif isinstance(w, QTabBar):
            out += [(f"{name} tab", w.tabText(i)) for i in range(w.count())]
            out += [(f"{name} tab tip", w.tabToolTip(i)) for i in range(w.count())]
        elif isinstance(w, QTableView) and w.model() is not None:
            model = w.model()
            out += [(f"{name} header", str(model.headerData(c, Qt.Orientation.Horizontal)))
                    for c in range(model.columnCount())]
            out += [(f"{name} cell", str(model.index(r, c).data() or "")) for r in range(model.rowCount())
                    for c in range(model.columnCount())]
        # the painted bars and charts of the Pool, Plan and Lengths pages: their labels and hover tips
        for item in [*getattr(w, "segments", ()), *getattr(w, "rows", ()), *getattr(w, "columns", ())]:
            out += [(f"{name} {field}", getattr(item, field)) for field in ("label", "tip", "name")
                    if isinstance(getattr(item, field, None), str)]
        if isinstance(getattr(w, "empty_text", None), str):
            out.append((f"{name} empty", w.empty_text))
        if getattr(w, "line", None) is not None and isinstance(getattr(w.line, "label", None), str):
            out.append((f"{name} line", w.line.label))
        if isinstance(w, QMenu) or w is root:
            for action in QWidget.actions(w):      # the window keeps a ChatActions in .actions
                out += [(f"{name} action", action.text()), (f"{name} action tip", action.statusTip())]
                if action.menu() is not None:
                    for sub in action.menu().actions():
                        out += [(f"{name} menu item", sub.text()), (f"{name} menu tip", sub.statusTip())]
    return [(where, text) for where, text in out if text]


def english_in(root) -> list[str]:
    return [f"{where}: {text!r} ({', '.join(words)})" for where, text in visible_texts(root)
            if (words := english_words(text))]


@pytest.fixture
def chinese(qtbot, monkeypatch, tmp_path):
    """The zh_CN catalog installed the way app.main does, removed again afterwards (other tests read English)."""
    isolate_app(monkeypatch, tmp_path)
    monkeypatch.setenv("KVCHAT_LANG", "zh_CN")
    from PySide6.QtWidgets import QApplication

    from kvchat.app import i18n
    app = QApplication.instance()
    assert i18n.install(app, "en") == "zh_CN"          # the override wins over the saved choice
    yield app
    for translator in app._kvchat_translators:
        app.removeTranslator(translator)
    app._kvchat_translators = []


@pytest.mark.gui
def test_chinese_window_dialogs_and_pages_show_no_english(chinese, qtbot):
    from kvchat.app.dialogs.about import AboutDialog
    from kvchat.app.dialogs.models_page import ModelsDialog
    from kvchat.engine.plan.library import ModelEntry

    window = open_window(qtbot, FakeLoader(), autoload=False)
    window.load_engine()
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    with qtbot.waitSignal(window.host.turn_finished, timeout=10_000):
        window.send("你好，请介绍一下你自己")
    qtbot.waitUntil(lambda: not window.generating, timeout=5000)
    assert window.send_button.text() == "发送"
    window.chat.add_message("assistant", "")          # the footer of a reply: Regenerate, Continue, Copy, Delete
    window.chat.messages()[-1].set_finish("length")
    window.chat.refresh_actions(busy=False)
    window.dashboard.redraw()
    problems = english_in(window)
    dashboard = window.dashboard
    t = dashboard.data.times[-1]
    for text in (dashboard.live.layer_hover_text(0), dashboard.live.series_hover_text("speed", t),
                 dashboard.live.series_hover_text("memory", t), dashboard.live.gauge.text()):
        assert text
        if words := english_words(text):
            problems.append(f"hover text {text!r} ({', '.join(words)})")
    for page in window.dashboard.page_names():
        window.dashboard.show_page(page)
        qtbot.wait(50)
        problems += english_in(window.dashboard)
    settings = window.open_settings()
    problems += english_in(settings)
    entry = ModelEntry("llama-q4", "/models/tiny.gguf", "Folder", "gguf", "llama", 135_000_000, "Q4_1",
                       90 * 2**20, 8192, (("fp16", 4096), ("int8", 8192), ("int4", None)))
    models = ModelsDialog([], scan=lambda folders, memory_bytes, **_: [entry], parent=window)
    qtbot.waitUntil(lambda: not models.scanning, timeout=5000)
    problems += english_in(models)
    about = AboutDialog("fake-model", "Q4_1", "default", window)
    problems += english_in(about)
    for dialog in (settings, models, about):
        dialog.close()
    chinese_texts = [text for root in (window, settings, models, about) for _, text in visible_texts(root)
                     if re.search(r"[\u4e00-\u9fff]", text)]
    assert len(chinese_texts) > 150         # the walk saw the interface, and the interface is in Chinese
    assert not problems, "English left in the Chinese interface:\n" + "\n".join(sorted(set(problems)))


def test_the_english_check_catches_english():
    """The detector itself: prose fails, units, formats and model names pass."""
    assert english_words("Send the edited message")
    assert english_words("<b>Pool</b>: 远程服务器不提供此项")
    assert not english_words("缓存中有 1,024 个 token · int8 K/V · 12.5 tok/s · 3.2 MiB")
    assert not english_words("SmolLM2-135M-Instruct（GGUF，Q4_1）")
