"""The engine's messages to the user (errors, refusals, notices) in the interface language.

The engine writes English and knows nothing of Qt; its messages are translated here, at the edge,
where they are shown. Each message the engine can send is written below once, as the engine
formats it, with {fields} where its numbers and names go: the same text is the pattern that
recognises the message and the source the catalog translates. A message not listed (or changed in
the engine since) is shown as it came, in English; tests/test_app_walk_three.py has the real engine
send most of them, so a change on the engine's side shows there.
"""
from __future__ import annotations

import re
from functools import lru_cache

from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication

from kvchat.app.field_labels import with_labels
from kvchat.app.i18n import label_text

CONTEXT = "EngineText"
MESSAGES = (
    QT_TRANSLATE_NOOP("EngineText", "The KV budget ({budget} MiB, {label}) is full: {held} tokens are held and "
                                    "{needed} more were needed, but only {left} fit. To go on: {advice}, or raise the "
                                    "budget in Settings."),
    QT_TRANSLATE_NOOP("EngineText", "The KV budget ({budget} MiB) cannot hold a window of {window} tokens plus "
                                    "{sinks} sinks in {label} while taking {new} new tokens: lower the window, choose "
                                    "a smaller format, or raise the budget in Settings."),
    QT_TRANSLATE_NOOP("EngineText", "The KV budget ({budget} MiB) is too small even for a sliding window: raise it."),
    QT_TRANSLATE_NOOP("EngineText", "The conversation would pass {model}'s context of {limit} tokens ({held} held, "
                                    "{needed} more needed): {advice}."),
    QT_TRANSLATE_NOOP("EngineText", "This conversation's cache was released to make room for another; its history "
                                    "is read again."),
    QT_TRANSLATE_NOOP("EngineText", "Cache restored from disk: {tokens} tokens in {seconds} s."),
    QT_TRANSLATE_NOOP("EngineText", "The saved cache was not used ({reason}); the history is read again."),
    QT_TRANSLATE_NOOP("EngineText", "This conversation's cache was read back from disk ({tokens} tokens, {seconds} s) "
                                    "after it was released to make room for another."),
    QT_TRANSLATE_NOOP("EngineText", "This conversation's cache was released to make room for another and could not "
                                    "be read back ({reason}); its history is read again."),
    QT_TRANSLATE_NOOP("EngineText", "The budget filled: the cache now slides, keeping the newest {window} tokens and "
                                    "{sinks} sinks."),
    QT_TRANSLATE_NOOP("EngineText", "window {window} + {sinks} sinks is longer than the model's context of {context} "
                                    "tokens: positions would run past what it was trained on; use a window of at most "
                                    "{most}"),
    QT_TRANSLATE_NOOP("EngineText", "a KV budget of {budget} MiB does not hold even one block of {block} tokens in "
                                    "{label} on this model (that needs {need} MiB): raise the budget"),
    QT_TRANSLATE_NOOP("EngineText", "a KV budget of {budget} MiB cannot hold {label} on this model: reading a prompt "
                                    "into the window needs {need} MiB; raise the budget to {need_again} MiB or more, "
                                    "or lower the window"),
    QT_TRANSLATE_NOOP("EngineText", "full-precision layers {layers} do not exist: this model has layers 0-{last}"),
    QT_TRANSLATE_NOOP("EngineText", "model path {path} does not exist: choose a local Hugging Face folder or a .gguf "
                                    "file"),
    QT_TRANSLATE_NOOP("EngineText", "{name}: expected a folder with config.json and *.safetensors, or a .gguf file"),
    QT_TRANSLATE_NOOP("EngineText", "{folder} has no config.json: it is not a Hugging Face model folder"),
    QT_TRANSLATE_NOOP("EngineText", "{name} is a pickle checkpoint, which can run arbitrary code: kvchat loads only "
                                    ".safetensors folders and .gguf files"),
    QT_TRANSLATE_NOOP("EngineText", "{name} is not a readable GGUF file ({error}); re-download or re-export it"),
    QT_TRANSLATE_NOOP("EngineText", "unsupported architecture {arch} in {where}: kvchat runs the Llama family "
                                    "({supported})"),
    QT_TRANSLATE_NOOP("EngineText", "unsupported architecture {arch} in {where}: mixture-of-experts families other "
                                    "than mixtral, qwen3_moe and gpt_oss are not supported yet; kvchat runs "
                                    "{supported}"),
    QT_TRANSLATE_NOOP("EngineText", "unsupported architecture 'gemma3' in {where}: this is Gemma 3's multimodal "
                                    "folder; kvchat runs its text model (model_type gemma3_text, or a Gemma 3 GGUF); "
                                    "it runs {supported}"),
    QT_TRANSLATE_NOOP("EngineText", "{where} has no chat template (a base model?): the chat is sent as plain text, "
                                    "'User:' and 'Assistant:' lines it continues; its replies may ramble or speak for "
                                    "the user"),
    QT_TRANSLATE_NOOP("EngineText", "there is no reply to regenerate yet: send a message first"),
    QT_TRANSLATE_NOOP("EngineText", "there is no reply to continue: send a message first"),
    QT_TRANSLATE_NOOP("EngineText", "the last reply ended on its own; send a message to go on"),
    QT_TRANSLATE_NOOP("EngineText", "C kernels not loaded ({reason}): running torch's kernels, several times slower"),
    QT_TRANSLATE_NOOP("EngineText", "C kernels: the baseline x86-64 build (without AVX2, FMA and F16C), several times slower"),
    QT_TRANSLATE_NOOP("EngineText", "C kernels built without OpenMP: one thread of {cores}"),
)
# the parts an {advice} field is made of, joined by ", "
PHRASES = (
    QT_TRANSLATE_NOOP("EngineText", "reset the session"),
    QT_TRANSLATE_NOOP("EngineText", "shorten the message"),
    QT_TRANSLATE_NOOP("EngineText", "switch to a sliding window"),
    QT_TRANSLATE_NOOP("EngineText", "choose a smaller format (int4)"),
    QT_TRANSLATE_NOOP("EngineText", "choose a smaller format (int8 or int4)"),
    QT_TRANSLATE_NOOP("EngineText", "shorten the message, or set a sliding window in Settings (a window bounds the "
                                    "cache)"),
    QT_TRANSLATE_NOOP("EngineText", "shorten the message, or set a window in Settings (the window then bounds the "
                                    "cache)"),
    QT_TRANSLATE_NOOP("EngineText", "switch the cache to a sliding window with sinks in Settings to keep going, or "
                                    "start a new chat"),
)
JOIN = QT_TRANSLATE_NOOP("EngineText", "{first}, {then}")      # how the parts of an {advice} are joined
_FIELD = re.compile(r"\{(\w+)\}")


@lru_cache(maxsize=None)
def _pattern(source: str) -> re.Pattern:
    """The English message as a pattern: its literal text, each {field} any text (as little as fits)."""
    parts = _FIELD.split(source)        # literal, field, literal, field, ...
    regex = "".join(re.escape(part) if i % 2 == 0 else f"(?P<{part}>.+?)" for i, part in enumerate(parts))
    return re.compile(regex + r"\Z", re.DOTALL)


def engine_text(text: str) -> str:
    """`text` from the engine in the interface language; as it is when the engine sent something not listed."""
    text = text or ""
    for source in MESSAGES:
        match = _pattern(source).match(text)
        if match is not None:
            fields = {name: _field(name, value) for name, value in match.groupdict().items()}
            return QCoreApplication.translate(CONTEXT, source).format(**fields)
    return with_labels(text)            # a field the engine names (block_size=0) by its label in Settings


def _field(name: str, value: str) -> str:
    if name == "advice":
        return _advice(value)
    if name == "label":
        return label_text(value)
    return value


def _advice(value: str) -> str:
    if value in PHRASES:
        return QCoreApplication.translate(CONTEXT, value)
    parts = value.split(", ")
    if not all(part in PHRASES for part in parts):
        return value
    out = QCoreApplication.translate(CONTEXT, parts[0])
    for part in parts[1:]:
        out = QCoreApplication.translate(CONTEXT, JOIN).format(first=out, then=QCoreApplication.translate(CONTEXT, part))
    return out
