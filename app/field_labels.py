"""The settings' own names in the engine's messages.

An engine ConfigError names a field as the code spells it ("block_size=0: use a whole number of tokens
from 1 to 256"); the user knows the setting by its label in Settings, so the name is replaced by that
label ("Block size (tokens) = 0: ..."). The labels are the Settings rows' texts, translated in the same
context.
"""
from __future__ import annotations

import re

from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication

CONTEXT = "SettingsDialog"
FIELD_LABELS = {
    "k_format": QT_TRANSLATE_NOOP("SettingsDialog", "K format"),
    "v_format": QT_TRANSLATE_NOOP("SettingsDialog", "V format"),
    "k_scheme": QT_TRANSLATE_NOOP("SettingsDialog", "Key quantization"),
    "full_precision_layers": QT_TRANSLATE_NOOP("SettingsDialog", "Full-precision layers"),
    "window": QT_TRANSLATE_NOOP("SettingsDialog", "Window (tokens)"),
    "sinks": QT_TRANSLATE_NOOP("SettingsDialog", "Sinks"),
    "block_size": QT_TRANSLATE_NOOP("SettingsDialog", "Block size (tokens)"),
    "budget_mb": QT_TRANSLATE_NOOP("SettingsDialog", "KV budget"),
    "overflow": QT_TRANSLATE_NOOP("SettingsDialog", "When the budget is full"),
    "temperature": QT_TRANSLATE_NOOP("SettingsDialog", "Temperature"),
    "top_p": QT_TRANSLATE_NOOP("SettingsDialog", "Top-p"),
    "top_k": QT_TRANSLATE_NOOP("SettingsDialog", "Top-k"),
    "max_new_tokens": QT_TRANSLATE_NOOP("SettingsDialog", "Max new tokens"),
}
# a field name as the engine writes it: the whole word, often followed by =value; "window" alone is a plain
# word too ("a window must hold..."), so it is replaced only where the engine wrote window=
_NAMED = re.compile(r"\b(" + "|".join(name for name in FIELD_LABELS if "_" in name) + r")\b(=)?"
                    r"|\b(window|sinks|overflow|temperature)=")


def with_labels(text: str) -> str:
    """`text` with each engine field name replaced by its Settings label."""
    def label(match: re.Match) -> str:
        name = match.group(1) or match.group(3)
        shown = QCoreApplication.translate(CONTEXT, FIELD_LABELS[name])
        return shown + (" = " if match.group(2) or match.group(3) else "")
    return _NAMED.sub(label, text or "")
