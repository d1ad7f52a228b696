"""Which format a model's replies come in: the one choice between the reply formats (engine/text/reasoning.py's
plain one, engine/text/harmony.py's), made from the tokenizer."""
from __future__ import annotations

from kvchat.engine.text.harmony import HarmonyFormat
from kvchat.engine.text.reasoning import PLAIN


def reply_format(tokenizer):
    """HarmonyFormat where the vocabulary has Harmony's markers as special tokens (gpt-oss), else PLAIN."""
    return HarmonyFormat.of(tokenizer) or PLAIN
