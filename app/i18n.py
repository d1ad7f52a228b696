"""The interface language: English (the source strings) or Simplified Chinese (resources/i18n).

Chosen, in this order, by KVCHAT_LANG (tests, screenshots), the Language choice in Settings
(QSettings key ui/language: "system", "en" or "zh_CN") and the system locale. The translators are
installed once at start, before any window is built; a new choice in Settings applies on restart.
"""
from __future__ import annotations

import os
from pathlib import Path

from PySide6.QtCore import QCoreApplication, QLibraryInfo, QLocale, QTranslator

I18N = Path(__file__).resolve().parent.parent / "resources" / "i18n"
LANGUAGES = ("system", "en", "zh_CN")       # the values stored in Settings
TRANSLATED = ("zh_CN",)                     # languages with a catalog in resources/i18n


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


def cache_label(cache) -> str:
    """CacheConfig.label() in the interface language ("int8", "K int8 / V fp8, window 256 + 4 sinks")."""
    kv = cache.k_format if cache.k_format == cache.v_format else f"K {cache.k_format} / V {cache.v_format}"
    if cache.k_format == "int4" and cache.k_scheme == "token":
        kv += QCoreApplication.translate("CacheLabel", " (per-token keys)")
    if cache.window is not None:
        kv += QCoreApplication.translate("CacheLabel", ", window {window} + {sinks} sinks").format(
            window=cache.window, sinks=cache.sinks)
    return kv
