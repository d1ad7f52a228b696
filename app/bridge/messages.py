"""What the engine worker tells the window, beyond the engine's own events.

Frozen dataclasses only: signals between the threads never carry dicts, tensors or live objects.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvchat.engine.api import LOCAL, Capabilities
from kvchat.engine.config import CacheConfig
from kvchat.engine.events import StatsSnapshot

if TYPE_CHECKING:
    from kvchat.engine.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class LoadProgress:
    message: str
    fraction: float | None              # 0.0-1.0, or None when the step has no measurable length


@dataclass(frozen=True, slots=True)
class EngineReady:
    model_name: str
    device: str
    num_layers: int
    load_s: float
    weights_label: str = ""             # e.g. "Q4_1 (+Q8_0), packed"
    weight_bytes: int = 0
    notice: str = ""                    # something to tell the user about the load (old caches removed)
    model_config: ModelConfig | None = None   # the model's shape, for validating cache settings
    dtype: str = "fp32"                 # the model dtype "auto" cache formats resolve to
    capabilities: Capabilities = LOCAL  # what the engine can show and do (a remote server: no per-layer data)
    server_url: str = ""                # a remote engine's base URL
    kernel_status: str = ""             # why the C kernels are missing (the engine's English line); "" when loaded
    chat_format_notice: str = ""        # the model has no chat template: it chats in plain text (the engine's line)
    prefill: str = ""                   # the prompt GEMM's precision as loaded ("fp32", "bf16", "int8"); "" for a server
    activations: str = ""               # decode rows' activations as loaded ("int16", "int8"); "" for a server
    saves_caches: bool = False          # it keeps each chat's KV cache on disk (saved when the app closes)
    linear_layers: int = 0              # of num_layers, those keeping a recurrent state: cache modes skip them
    shared_kv_layers: int = 0           # of num_layers, those reading an earlier layer's K and V (none of their own)


@dataclass(frozen=True, slots=True)
class SessionOpened:
    conversation_id: int | None
    cache: CacheConfig
    num_messages: int
    stats: StatsSnapshot | None
    restored_tokens: int = 0            # its KV cache was read back from disk (warm conversations)


@dataclass(frozen=True, slots=True)
class ModeSwitched:
    old: CacheConfig
    new: CacheConfig
    stats: StatsSnapshot | None


@dataclass(frozen=True, slots=True)
class ResetDone:
    freed_bytes: int
    stats: StatsSnapshot | None


@dataclass(frozen=True, slots=True)
class PrefixCleared:
    freed_bytes: int                    # blocks kept only for prefix reuse, given back to the pool
    stats: StatsSnapshot | None


@dataclass(frozen=True, slots=True)
class ReadingHistory:
    """A turn reads a chat's history into an empty cache first (a reopened or released chat); 0: done reading."""

    tokens: int                         # tokens to read; 0 when the turn's first token or its end came


@dataclass(frozen=True, slots=True)
class SavingCaches:
    """The app is closing: the engine thread saves this many chats' caches, then ends."""

    num_chats: int


@dataclass(frozen=True, slots=True)
class SavedCaches:
    """The chats' caches saved on disk, counted on the engine thread (which writes them), for Settings."""

    num_files: int
    total_bytes: int
    deleted_bytes: int = 0              # what a DeleteSavedCaches just removed


@dataclass(frozen=True, slots=True)
class MessageCounted:
    """A long message counted before it is shown as sent: the open chat's tokens with it, against the context."""

    text: str
    tokens: int                         # the conversation with the message, as the model reads it
    context: int                        # the model's context in tokens (0: unknown or bounded by a window)


@dataclass(frozen=True, slots=True)
class TokenCounts:
    """Tokens of saved conversations by the loaded model's tokenizer (the Lengths tab)."""

    model_name: str
    counts: tuple[tuple[int, int], ...]     # (conversation id, tokens)


@dataclass(frozen=True, slots=True)
class PrefillSet:
    """The prompt GEMM's precision the engine now uses, after a change from Settings."""

    precision: str                      # "fp32", "bf16"


@dataclass(frozen=True, slots=True)
class ActivationsSet:
    """Decode rows' activations the engine now uses, after a change from Settings."""

    precision: str                      # "int16", "int8"


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    """Something the user must hear about. `kind` says which command failed."""

    kind: str                           # "load", "session", "send", "cache", "reset", "speculative"
    title: str
    message: str                        # what happened and what to do, in one or two sentences


def format_bytes(num_bytes: float) -> str:
    """Binary units, as the dashboard axes use them: 0 B, 512 B, 3.5 KiB, 12.0 MiB, 1.25 GiB."""
    value = float(num_bytes)
    if abs(value) < 1024:
        return f"{int(value)} B"
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024.0
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.2f} {unit}" if abs(value) < 10 else f"{value:.1f} {unit}"
    raise AssertionError("unreachable")
