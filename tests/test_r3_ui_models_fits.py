"""The Models page's "Fits" columns mark a length past the model's trained context (issue 37, item 10), as
`kvchat estimate` does: memory would hold it, the model was not trained for it."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from PySide6.QtCore import Qt

from kvchat.app.dialogs.models_page import COLUMNS, SORT_ROLE, ModelTable
from kvchat.engine.plan.library import ModelEntry

pytestmark = pytest.mark.gui


def test_fits_past_the_trained_context_say_so_and_still_sort_by_tokens(qtbot):
    entry = ModelEntry("llama-8k", "/models/llama-8k", "Folder", "gguf", "llama", 8_030_000_000, "Q4_K", 4 << 30,
                       8192, (("fp16", 806_000), ("int8", 8192), ("int4", None)), "")
    table = ModelTable()
    table.set_entries([entry])

    def cell(column, role=Qt.ItemDataRole.DisplayRole):
        return table.data(table.index(0, COLUMNS.index(column)), role)

    assert cell("Fits fp16") == "806k (past trained 8,192)"
    assert "trained on 8,192" in cell("Fits fp16", Qt.ItemDataRole.ToolTipRole)
    assert "806,000 tokens" in cell("Fits fp16", Qt.ItemDataRole.ToolTipRole)
    assert cell("Fits int8") == "8,192" and cell("Fits int8", Qt.ItemDataRole.ToolTipRole) == entry.path  # at it
    assert cell("Fits int4") == "any"                   # a window bounds it: nothing runs past
    assert cell("Fits fp16", SORT_ROLE) == 806_000
