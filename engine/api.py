"""The engine boundary the app talks to: a Protocol that the local Engine, RemoteEngine and the test
fake all satisfy, plus what each can do (capabilities), so the GUI greys out what an engine cannot show
instead of drawing zeros. Qt-free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Protocol, runtime_checkable

from kvchat.engine.config import CacheConfig, SamplingParams
from kvchat.engine.events import PrefillProgress, StatsSnapshot, TokenDelta, TurnFinished

if TYPE_CHECKING:
    from kvchat.engine.runtime.session_stats import CacheSwitch


@dataclass(frozen=True, slots=True)
class Capabilities:
    per_layer_stats: bool       # stats().layers holds real per-layer K/V bytes and formats
    live_cache_switch: bool     # session.set_cache converts the cache in place
    remote: bool                # the model runs elsewhere; server numbers come in stats().server
    edits_history: bool = False     # a session can regenerate, continue_reply, rewind and select_alternative
    saves_caches: bool = False      # keep_warm / restore_warm / save_warm and warm_store: chats' caches on disk
    speculative: bool = False       # set_speculative changes how the next turns decode
    prefill_precision: bool = False     # set_prefill changes the prompt GEMM's precision; .prefill names it
    decode_precision: bool = False      # set_activations changes decode rows' activations; .activations names them
    prefix_cache: bool = False      # clear_prefix_cache frees blocks kept only for prefix reuse
    attention: bool = False         # a session can watch_attention() and give attention() maps (where attention goes)


LOCAL = Capabilities(per_layer_stats=True, live_cache_switch=True, remote=False, edits_history=True,
                     saves_caches=True, speculative=True, prefill_precision=True, decode_precision=True,
                     prefix_cache=True, attention=True)
REMOTE = Capabilities(per_layer_stats=False, live_cache_switch=False, remote=True)


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What a loaded engine says about itself (`describe()`): the load event and the dashboard's header read these,
    so the app asks once instead of probing attributes. Text fields are "" where there is nothing to say."""

    model_name: str
    device: str
    num_layers: int                 # 0 where per-layer data is not available (a remote engine)
    weights_label: str = ""         # how the weights are held: "Q4_K_M GGUF, packed", "remote"...
    weight_bytes: int = 0           # what they hold in memory here (0 remote)
    dtype_name: str = "fp32"        # the activations' dtype
    notice: str = ""                # something the user should hear about the load
    kernel_status: str = ""         # why the C kernels are missing, if they are
    chat_format_notice: str = ""    # why replies may read oddly (a template we could not use)
    linear_layers: int = 0          # layers that keep a recurrent state, not K and V (Qwen3.5's Gated DeltaNet)


@runtime_checkable
class ChatSession(Protocol):
    messages: list[dict]

    @property
    def cache_config(self) -> CacheConfig: ...

    def send(self, text: str, params: SamplingParams | None = None,
             should_stop: Callable[[], bool] | None = None) -> Iterator[PrefillProgress | TokenDelta | TurnFinished]: ...

    def set_cache(self, config: CacheConfig) -> "CacheSwitch | None": ...   # tokens held before / after / lost; None remote

    def reset(self) -> int: ...

    def stats(self) -> StatsSnapshot: ...


@runtime_checkable
class ChatEngine(Protocol):
    model_name: str
    num_layers: int

    def new_session(self, system_prompt: str | None = None, cache: CacheConfig | None = None,
                    history: list[dict] | None = None) -> ChatSession: ...

    def describe(self) -> EngineFacts: ...


def capabilities_of(engine) -> Capabilities:
    """An engine's capabilities; the local Engine (which does not declare them yet) has every local one."""
    return getattr(engine, "capabilities", LOCAL)
