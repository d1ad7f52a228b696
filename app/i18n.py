"""The interface language: English (the source strings) or Simplified Chinese (resources/i18n).

Chosen, in this order, by KVCHAT_LANG (tests, screenshots), the Language choice in Settings
(QSettings key ui/language: "system", "en" or "zh_CN") and the system locale. The translators are
installed once at start, before any window is built; a new choice in Settings applies on restart.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication, QLibraryInfo, QLocale, QTranslator

I18N = Path(__file__).resolve().parent.parent / "resources" / "i18n"
LANGUAGES = ("system", "en", "zh_CN")       # the values stored in Settings
TRANSLATED = ("zh_CN",)                     # languages with a catalog in resources/i18n
# the engine's own words for cache formats, key schemes and overflow policies, as the interface names them
# (English keeps the engine's word, but "auto" is "full precision", the name the presets and the dashboard use;
# the values stored and passed on stay the engine's)
VALUE_NAMES = {"auto": QT_TRANSLATE_NOOP("EngineValue", "full precision"),
               "channel": QT_TRANSLATE_NOOP("EngineValue", "channel"),
               "token": QT_TRANSLATE_NOOP("EngineValue", "token"), "stop": QT_TRANSLATE_NOOP("EngineValue", "stop"),
               "slide": QT_TRANSLATE_NOOP("EngineValue", "slide")}
PACKED_SUFFIX = ", packed"                  # engine.weights_label: "Q4_1 (+Q8_0), packed"
_WINDOW = re.compile(r", (?:window|keeping) ([\d,]+) (by attention )?\+ (\d+) sinks")  # the parts of CacheConfig.label()
_READING = re.compile(r", reading (\d+) blocks a token")
PER_TOKEN = " (per-token keys)"


def language_names() -> dict[str, str]:
    """The Settings choices, each language named in itself."""
    return {"system": QCoreApplication.translate("Language", "System"), "en": "English", "zh_CN": "中文"}


def resolve(choice: str | None, system: QLocale | None = None) -> str:
    """"en" or "zh_CN" for a stored choice ("system" asks the locale; anything unknown is English)."""
    choice = (choice or "system").strip()
    if choice in ("system", ""):
        locale = system or QLocale.system()
        return "zh_CN" if locale.language() == QLocale.Language.Chinese else "en"
    if choice.lower().replace("-", "_").startswith("zh"):
        return "zh_CN"
    return "en"


def catalog(language: str) -> Path:
    return I18N / f"kvchat_{language}.qm"


def install(app: QCoreApplication, choice: str | None) -> str:
    """Install the translators for the chosen language; the language used ("en" or "zh_CN").

    KVCHAT_LANG overrides the choice. A missing catalog leaves the interface in English."""
    language = resolve(os.environ.get("KVCHAT_LANG") or choice)
    if language not in TRANSLATED:
        return "en"
    translators = []
    ours = QTranslator(app)
    if not ours.load(str(catalog(language))):
        return "en"
    translators.append(ours)
    qt_base = QTranslator(app)          # Qt's own buttons (OK, Cancel, Yes) from the PySide6 wheel
    if qt_base.load(f"qtbase_{language}", QLibraryInfo.path(QLibraryInfo.LibraryPath.TranslationsPath)):
        translators.append(qt_base)
    for translator in translators:
        app.installTranslator(translator)
    app._kvchat_translators = translators   # kept alive with the application
    return language


def value_name(value: str) -> str:
    """An engine value ("auto", "channel", "stop", ...) in the interface language; other values as they are."""
    return QCoreApplication.translate("EngineValue", VALUE_NAMES[value]) if value in VALUE_NAMES else value


def weights_text(label: str) -> str:
    """The engine's weights label in the interface language ("Q4_1 (+Q8_0), packed")."""
    if label.endswith(PACKED_SUFFIX):
        return QCoreApplication.translate("EngineValue", "{quant}, packed").format(quant=label[:-len(PACKED_SUFFIX)])
    return value_name(label)


def cache_label(cache) -> str:
    """CacheConfig.label() in the interface language ("int8", "K int8 / V fp8, window 256 + 4 sinks")."""
    k, v = value_name(cache.k_format), value_name(cache.v_format)
    kv = k if cache.k_format == cache.v_format else f"K {k} / V {v}"
    if cache.k_format == "int4" and cache.k_scheme == "token":
        kv += QCoreApplication.translate("CacheLabel", " (per-token keys)")
    if cache.window is not None and cache.eviction == "importance":
        kv += QCoreApplication.translate("CacheLabel", ", keeping {window} by attention + {sinks} sinks").format(
            window=cache.window, sinks=cache.sinks)
    elif cache.window is not None:
        kv += QCoreApplication.translate("CacheLabel", ", window {window} + {sinks} sinks").format(
            window=cache.window, sinks=cache.sinks)
    if cache.retrieval_blocks is not None:
        kv += QCoreApplication.translate("CacheLabel", ", reading {blocks} blocks a token").format(
            blocks=cache.retrieval_blocks)
    return kv


def label_text(label: str) -> str:
    """A cache label the engine wrote ("K int8 / V auto, window 256 + 4 sinks") in the interface language."""
    window, reading = _WINDOW.search(label), _READING.search(label)
    found = [m for m in (window, reading) if m]
    head = label[:min(m.start() for m in found)] if found else label
    per_token = head.endswith(PER_TOKEN)
    head = " ".join(value_name(word) for word in head.removesuffix(PER_TOKEN).split(" "))
    if per_token:
        head += QCoreApplication.translate("CacheLabel", " (per-token keys)")
    if window and window.group(2):
        head += QCoreApplication.translate("CacheLabel", ", keeping {window} by attention + {sinks} sinks").format(
            window=window.group(1), sinks=window.group(3))
    elif window:
        head += QCoreApplication.translate("CacheLabel", ", window {window} + {sinks} sinks").format(
            window=window.group(1), sinks=window.group(3))
    if reading:
        head += QCoreApplication.translate("CacheLabel", ", reading {blocks} blocks a token").format(
            blocks=reading.group(1))
    return head + (label[max(m.end() for m in found):] if found else "")


def fill_choices(combo, values, current: str) -> None:
    """A combo box of engine values, each shown by its name in the interface language, `current` chosen."""
    for value in values:
        combo.addItem(value_name(value), value)
    choose(combo, current)


def choose(combo, value: str) -> None:
    index = combo.findData(value)
    if index >= 0:
        combo.setCurrentIndex(index)


def choice(combo) -> str:
    """The engine value behind a combo box's shown name."""
    value = combo.currentData()
    return value if isinstance(value, str) else combo.currentText()
