"""Frozen configuration dataclasses: every boundary of the engine takes one of these.

Invariants are checked at construction, with messages a user can act on.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from numbers import Integral, Real
from typing import TYPE_CHECKING

from kvchat.engine.errors import UserError

if TYPE_CHECKING:
    from kvchat.engine.model.config import ModelConfig

FULL_FORMATS = ("auto", "fp32", "fp16", "bf16")
QUANT_FORMATS = ("int8", "fp8", "int4")
FORMATS = FULL_FORMATS + QUANT_FORMATS
KEY_SCHEMES = ("channel", "token")
OVERFLOW_POLICIES = ("stop", "slide")
EVICTIONS = ("window", "importance")
RETRIEVAL_NEWEST = 2        # newest blocks every retrieval step reads besides the sinks and the chosen ones


class ConfigError(UserError, ValueError):
    """A setting that cannot work; the message says what to change."""


def _is_whole(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """How the KV cache is stored.

    k_format / v_format: auto (model dtype), fp32, fp16, bf16, int8, fp8 (e4m3) or int4.
    k_scheme: "channel" quantizes keys per channel over each full block (KIVI/KVQuant style);
        "token" quantizes keys per token (per head for int8/fp8, groups of 32 for int4).
    full_precision_layers: layer indices kept in the model dtype whatever the formats say.
    window / sinks: keep the first `sinks` tokens and the newest `window` tokens (StreamingLLM);
        window=None keeps everything.
    eviction: which blocks leave once `window` tokens are held: "window" (the oldest after the sinks) or
        "importance" (the least attended, by the attention the kernels measure: SnapKV's observation window of a
        prompt, the mass of the reply so far; the sinks and the newest blocks stay, positions never move).
    retrieval_blocks: K: every block stays, and each generated token reads the sinks, the newest blocks and the K
        blocks whose keys may score highest against its query (Quest's bound from per-block min/max keys), per
        layer; None reads every block.
    budget_mb: the most KV memory the session may hold, in MiB.
    overflow: what a turn does when the budget is full: "stop" or "slide" into a window.
    """

    k_format: str = "auto"
    v_format: str = "auto"
    k_scheme: str = "channel"
    full_precision_layers: tuple[int, ...] = ()
    window: int | None = None
    sinks: int = 4
    block_size: int = 16
    budget_mb: float = 1024.0
    overflow: str = "stop"
    eviction: str = "window"
    retrieval_blocks: int | None = None

    def __post_init__(self):
        for name in ("k_format", "v_format"):
            value = getattr(self, name)
            if value not in FORMATS:
                raise ConfigError(f"{name}={value!r} is not a cache format; choose one of {', '.join(FORMATS)}")
        if self.k_scheme not in KEY_SCHEMES:
            raise ConfigError(f"k_scheme={self.k_scheme!r}: choose 'channel' or 'token'")
        try:
            layers = tuple(self.full_precision_layers)
        except TypeError:
            raise ConfigError(f"full_precision_layers={self.full_precision_layers!r}: give a list of layer numbers") from None
        if not all(_is_whole(i) for i in layers):
            raise ConfigError(f"full_precision_layers={layers!r}: layer numbers are whole numbers like 0, 1, 29")
        object.__setattr__(self, "full_precision_layers", tuple(sorted(set(int(i) for i in layers))))
        if any(i < 0 for i in self.full_precision_layers):
            raise ConfigError("full_precision_layers must be layer indices >= 0")
        if not _is_whole(self.block_size) or not 1 <= self.block_size <= 256:
            raise ConfigError(f"block_size={self.block_size!r}: use a whole number of tokens from 1 to 256 (16 is a good default)")
        if not _is_whole(self.sinks):
            raise ConfigError(f"sinks={self.sinks!r}: the number of attention-sink tokens is a whole number (4 is typical)")
        if self.sinks < 0:
            raise ConfigError(f"sinks={self.sinks}: the number of attention-sink tokens cannot be negative")
        if self.window is not None:
            if not _is_whole(self.window):
                raise ConfigError(f"window={self.window!r}: the window is a whole number of tokens (or None for no window)")
            if self.window < 1:
                raise ConfigError(f"window={self.window}: a window must hold at least 1 token (or use None for no window)")
            if self.window < self.block_size:
                raise ConfigError(f"window={self.window} is smaller than one block ({self.block_size} tokens): "
                                  f"raise the window or lower block_size")
        if isinstance(self.budget_mb, bool) or not isinstance(self.budget_mb, (int, float)) \
                or not math.isfinite(self.budget_mb) or not self.budget_mb > 0:
            raise ConfigError(f"budget_mb={self.budget_mb!r}: the KV budget must be a finite, positive number of MiB")
        if self.overflow not in OVERFLOW_POLICIES:
            raise ConfigError(f"overflow={self.overflow!r}: choose 'stop' (end the turn with a message) or 'slide' (switch to a window)")
        if self.overflow == "slide" and self.window is None and self.budget_mb <= 0:
            raise ConfigError("overflow='slide' needs a positive budget")
        self._check_choice()

    def _check_choice(self) -> None:
        """eviction and retrieval_blocks: what may be asked of them beside the window."""
        bs, sink_blocks = self.block_size, -(-self.sinks // self.block_size)
        if self.eviction not in EVICTIONS:
            raise ConfigError(f"eviction={self.eviction!r}: choose 'window' (the oldest go) or 'importance' (the "
                              f"least attended go)")
        if self.eviction == "importance":
            if self.window is None:
                raise ConfigError("eviction='importance' keeps `window` tokens: give a window (e.g. 1024)")
            least = (max(1, sink_blocks) + 2) * bs
            if self.window < least:
                raise ConfigError(f"window={self.window} is too small to keep the sinks, the newest block and one "
                                  f"chosen block ({bs}-token blocks): use at least {least}")
        if self.retrieval_blocks is not None:
            if not _is_whole(self.retrieval_blocks) or self.retrieval_blocks < 1:
                raise ConfigError(f"retrieval_blocks={_shown(self.retrieval_blocks)}: the blocks each token reads "
                                  f"beside the sinks and the newest, a whole number from 1 (or None to read all)")
            if self.window is not None:
                raise ConfigError("retrieval_blocks keeps every block and reads the chosen ones: it takes no window "
                                  "(use eviction='importance' with a window to keep fewer)")
            if self.overflow == "slide":
                raise ConfigError("retrieval_blocks keeps every block: overflow='slide' would drop them; use "
                                  "overflow='stop'")

    @property
    def is_quantized(self) -> bool:
        return self.k_format in QUANT_FORMATS or self.v_format in QUANT_FORMATS

    def label(self) -> str:
        """Short human name of the mode, for status lines and plots."""
        kv = self.k_format if self.k_format == self.v_format else f"K {self.k_format} / V {self.v_format}"
        if self.k_format == "int4" and self.k_scheme == "token":
            kv += " (per-token keys)"
        if self.window is not None and self.eviction == "importance":
            kv += f", keeping {self.window} by attention + {self.sinks} sinks"
        elif self.window is not None:
            kv += f", window {self.window} + {self.sinks} sinks"
        if self.retrieval_blocks is not None:
            kv += f", reading {self.retrieval_blocks} blocks a token"
        return kv

    def with_(self, **changes) -> "CacheConfig":
        return replace(self, **changes)


GREEDY_BELOW = 1e-5        # a temperature this low is greedy: dividing logits by it only overflows
MAX_SEED = 2**64 - 1        # torch's generators take 64-bit seeds
# a logit scaled by more than this (either way) only overflows or vanishes: 1e-300 made every logit infinite
REPETITION_PENALTY_RANGE = (0.01, 100.0)
PRESENCE_PENALTY_RANGE = (-2.0, 2.0)        # OpenAI's ranges
LOGIT_BIAS_RANGE = (-100.0, 100.0)


def _shown(value) -> str:
    try:
        text = repr(value)
    except ValueError:          # an int past Python's digit limit
        return f"a {type(value).__name__} too long to show"
    return text if len(text) <= 60 else text[:57] + "..."


def _number(obj, name: str, kind: type, ok, advice: str):
    """obj.name as a finite `kind` (bool is not a number here) for which ok(value) holds, stored as that kind."""
    value = getattr(obj, name)
    if kind is int:
        fits = _is_whole(value)
    else:
        try:
            fits = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(float(value))
        except OverflowError:       # an int past float's range
            fits = False
    if not fits or not ok(value):
        raise ConfigError(f"{name}={_shown(value)}: {advice}")
    object.__setattr__(obj, name, kind(value))
    return kind(value)


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """A logit bias as (token id, bias) pairs sorted by id, from pairs or a mapping {id: bias}."""
    lo, hi = LOGIT_BIAS_RANGE
    advice = f"give token ids (whole numbers from 0) with a bias from {lo:g} to {hi:g} each"
    try:
        pairs = list(value.items()) if isinstance(value, Mapping) else [tuple(p) for p in value]
    except TypeError:
        raise ConfigError(f"logit_bias={_shown(value)}: {advice}") from None
    out = {}
    for pair in pairs:
        if len(pair) != 2:
            raise ConfigError(f"logit_bias={_shown(value)}: {advice}")
        token, bias = pair
        try:
            fits = isinstance(bias, Real) and not isinstance(bias, bool) and lo <= float(bias) <= hi
        except OverflowError:
            fits = False
        if not (_is_whole(token) and token >= 0 and fits):
            raise ConfigError(f"logit_bias={_shown(value)}: {advice}")
        out[int(token)] = float(bias)
    return tuple(sorted(out.items()))


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the next token is chosen. A temperature below GREEDY_BELOW is stored as 0 (greedy), so every
    sampler (the session's, the server's, the one-shot path's) treats it alike."""

    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 256
    seed: int | None = None
    presence_penalty: float = 0.0       # OpenAI's: subtracted once from each token already generated
    frequency_penalty: float = 0.0      # OpenAI's: subtracted per time a token was generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), by id; a mapping is taken too

    def __post_init__(self):
        t = _number(self, "temperature", float, lambda v: v >= 0, "use a finite number: 0 for greedy, or e.g. 0.7")
        object.__setattr__(self, "temperature", 0.0 if t < GREEDY_BELOW else t)
        _number(self, "top_k", int, lambda v: v >= 0, "use a whole number: 0 to disable, or how many tokens to keep")
        _number(self, "top_p", float, lambda v: 0 < v <= 1, "use a finite number above 0 and at most 1 (1 disables it)")
        lo, hi = REPETITION_PENALTY_RANGE
        _number(self, "repetition_penalty", float, lambda v: lo <= v <= hi,
                f"use a number from {lo:g} to {hi:g} (1.0 disables it; 1.1 to 1.3 is typical)")
        _number(self, "max_new_tokens", int, lambda v: v >= 1, "use a whole number of tokens, at least 1")
        if self.seed is not None:
            _number(self, "seed", int, lambda v: 0 <= v <= MAX_SEED,
                    f"use a whole number from 0 to {MAX_SEED}, or none for a new seed each time")
        lo, hi = PRESENCE_PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            _number(self, name, float, lambda v: lo <= v <= hi, f"use a number from {lo:g} to {hi:g} (0 disables it)")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


SPEC_METHODS = ("off", "lookup", "draft")
MAX_DRAFTS = 32


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses up to k tokens after the next one, one step verifies them all.

    method: "off", "lookup" (prompt lookup: the tokens that followed the last n-gram's latest earlier match in the
    conversation, n from ngram_max down to ngram_min) or "draft" (a smaller model sharing the tokenizer, draft_model:
    a model spec as EngineConfig.model takes, or "self" for the loaded model itself, which shows the mechanics).
    adaptive: the number proposed follows what was accepted (up to k)."""

    method: str = "lookup"
    k: int = 8
    ngram_max: int = 3
    ngram_min: int = 2
    adaptive: bool = True
    draft_model: str | None = None

    def __post_init__(self):
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"speculative method={self.method!r}: choose off, lookup or draft")
        _number(self, "k", int, lambda v: 1 <= v <= MAX_DRAFTS,
                f"use a whole number of draft tokens from 1 to {MAX_DRAFTS} (4 to 8 is typical)")
        _number(self, "ngram_max", int, lambda v: 1 <= v <= 16, "use a whole number of tokens from 1 to 16 (3 is typical)")
        _number(self, "ngram_min", int, lambda v: 1 <= v <= self.ngram_max,
                f"use a whole number of tokens from 1 to ngram_max ({self.ngram_max})")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"adaptive={self.adaptive!r}: use true or false")
        if self.method == "draft" and not (isinstance(self.draft_model, str) and self.draft_model.strip()):
            raise ConfigError("speculative method 'draft' needs a draft model: a .gguf file, a model folder, or 'self'")

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    def label(self) -> str:
        if self.method == "off":
            return "off"
        if self.method == "lookup":
            return f"prompt lookup, k={self.k}"
        return f"draft {self.draft_model}, k={self.k}"


PREFILL_MODES = ("auto", "fp32", "bf16", "int8")
ACTIVATION_MODES = ("int16", "int8")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "default"            # "default", a local HF folder, or a .gguf file
    device: str = "auto"              # auto, cpu, cuda, cuda:N
    dtype: str = "auto"               # auto (fp32 on CPU, bf16 on CUDA), fp32, fp16, bf16
    weights: str = "auto"             # auto (a GGUF's own blocks, packed; a folder's stored dtype), dense (the
                                      # dtype above: the exact reference), or int8 / int4 (quantize on load)
    cache: CacheConfig = field(default_factory=CacheConfig)
    num_threads: int | None = None
    kv_disk_budget_mb: float = 2048.0  # saved conversation caches (warm conversations) in the user cache dir
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    prefill: str = "auto"             # prompt rows over packed weights on the CPU: fp32 (exact over the dequantized
                                      # weights), bf16 (oneDNN's bf16 GEMM), int8 (activations rounded as
                                      # llama.cpp's Q8_0, AVX2 or AVX-512), or auto (measured: engine.choose_prefill)
    activations: str = "int16"        # decode rows over packed weights in the C kernels: int16 per group of 32 (exact
                                      # to ~1e-5), or int8 (llama.cpp's Q8_0 rounding: opt-in, see the README)

    def __post_init__(self):
        if not isinstance(self.speculative, SpeculativeConfig):
            raise ConfigError(f"speculative={self.speculative!r}: give a SpeculativeConfig")
        if isinstance(self.kv_disk_budget_mb, bool) or not isinstance(self.kv_disk_budget_mb, (int, float)) \
                or not 0 <= self.kv_disk_budget_mb <= 1 << 24:
            raise ConfigError(f"kv_disk_budget_mb={self.kv_disk_budget_mb!r}: choose 0 (keep no caches) to 16 TiB")
        if not self.device.startswith(("auto", "cpu", "cuda")):
            raise ConfigError(f"device={self.device!r}: choose auto, cpu or cuda[:N]")
        if self.dtype not in ("auto", "fp32", "fp16", "bf16"):
            raise ConfigError(f"dtype={self.dtype!r}: choose auto, fp32, fp16 or bf16")
        if self.weights not in ("auto", "dense", "int8", "int4"):
            raise ConfigError(f"weights={self.weights!r}: choose auto, dense, int8 or int4")
        if self.prefill not in PREFILL_MODES:
            raise ConfigError(f"prefill={self.prefill!r}: choose {', '.join(PREFILL_MODES)}")
        if self.activations not in ACTIVATION_MODES:
            raise ConfigError(f"activations={self.activations!r}: choose {', '.join(ACTIVATION_MODES)}")
