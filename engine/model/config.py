"""A model's shape and settings (ModelConfig), read from config.json or a GGUF's metadata; no torch here.

The shape is flat fields; what each layer computes is `layers`, one LayerSpec per layer (engine/model/spec.py),
which the family registry (engine/model/families.py) builds from the same fields.

Past 450 lines on purpose: the two readers (config.json, GGUF metadata) fill the same fields and are checked the
same way; side by side, a field read one way and not the other shows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from kvchat.engine.errors import ModelLoadError
from kvchat.engine.model.families import Ropes, family, family_of
from kvchat.engine.model.spec import LayerSpec, Rope, yarn_attention_factor


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape, and the description of every layer.

    rope_theta / rope_scaling are the model's own rotary settings (a layer with other ones, such as Gemma 3's
    sliding layers, says so in its LayerSpec); qkv_bias / o_bias / mlp_bias say whether any layer has that
    bias. Built without `layers` (the presets, tests), every layer is the Llama layer these fields describe.
    """
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple  # (type, factor, low_freq_factor, high_freq_factor, original_max), ("factors", (f, ...)), or ()
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    embed_scale: float = 1.0                # the embedding rows times this (Gemma: sqrt(hidden))
    final_softcap: float | None = None      # logits -> cap * tanh(logits / cap) (Gemma 2); None: not capped
    layers: tuple[LayerSpec, ...] = ()
    longrope: tuple = ()                    # LongRoPE: (original context, short factors, long factors); see for_context
    # per-layer input embeddings (Gemma 4's E2B / E4B): each layer adds a gated projection of its own slice of a
    # second embedding (per_layer_vocab rows of num_layers x per_layer_input) mixed with a projection of the token's
    # embedding; 0: none
    per_layer_input: int = 0
    per_layer_vocab: int = 0

    def __post_init__(self):
        _check_numbers({"vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                        "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
                        "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
                        "intermediate_size": self.intermediate_size,
                        "max_position_embeddings": self.max_position_embeddings,
                        "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta}, "the model config", {})
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads={self.num_heads} is not a multiple of "
                                 f"num_key_value_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if not self.layers:
            layer = LayerSpec(rope=self.rope, query_scale=self.head_dim ** -0.5, qkv_bias=self.qkv_bias,
                              o_bias=self.o_bias, mlp_bias=self.mlp_bias)
            object.__setattr__(self, "layers", (layer,) * self.num_layers)
        # a description that disagrees with the flat fields is a programming error (a replace() of one of them)
        if len(self.layers) != self.num_layers:
            raise ValueError(f"{len(self.layers)} layer specs for {self.num_layers} layers")
        for name in ("qkv_bias", "o_bias", "mlp_bias"):
            if getattr(self, name) != any(getattr(layer, name) for layer in self.layers):
                raise ValueError(f"{name}={getattr(self, name)} but the layer specs say otherwise")

    @property
    def rope(self) -> Rope:
        """The model's own rotary settings (see the class docstring)."""
        return Rope(self.rope_theta, self.rope_scaling)

    @property
    def fused_kernel_ok(self) -> bool:
        """Whether the one-call C step covers the model's arithmetic: every layer (LayerSpec.fused_kernel_ok) with
        one query scale, and one rope without a window of its own for all of them (a step attending inside the
        kernel takes one cos / sin table and one scale for all layers), or, beside layers without one, a sliding window with its
        own rope (Gemma 3's local layers: two KV layouts, so every step's attention calls back, layer by layer).
        The embeddings' scale and the logits' cap are the forward's, around the call. The weights' packing is the
        linears' to say."""
        first = self.layers[0]
        windows = {layer.window is None for layer in self.layers}
        full = {layer.rope for layer in self.layers if layer.window is None}     # one table: Phi-4-mini's partial too
        return all(layer.fused_kernel_ok and layer.query_scale == first.query_scale
                   and (layer.window is None and len(full) == 1 or layer.window is not None and len(windows) == 2)
                   for layer in self.layers)

    @property
    def mixers_called_back(self) -> bool:
        """Whether some layer's token mixer is the forward's own in the one-call step (LayerSpec.mixer_called_back):
        the step then calls back for every layer's attention."""
        return any(layer.mixer_called_back for layer in self.layers)

    @property
    def one_table_ok(self) -> bool:
        """Whether the torch-free one-shot path (runtime/quick.py) computes the model: the one-call step's rule with
        one rope turning whole heads and no window for every layer, no post-norms, SwiGLU, no biases, sink logits or
        capped scores, unscaled embeddings and uncapped logits (its table and its attention are the Llama layer's)."""
        return (self.fused_kernel_ok and self.embed_scale == 1.0 and self.final_softcap is None
                and all(layer.window is None and not layer.mixer_called_back and not layer.post_norms
                        and layer.activation == "silu" and layer.rope.dims is None and not (layer.qkv_bias or layer.o_bias or layer.mlp_bias)
                        and not layer.sink_logits and layer.attn_softcap is None for layer in self.layers))

    def with_rope_scaling(self, scaling: tuple) -> "ModelConfig":
        """This config with the model's rope scaling replaced, in every layer that used the model's rope."""
        old, new = self.rope, Rope(self.rope_theta, scaling)
        layers = tuple(replace(layer, rope=new) if layer.rope == old else layer for layer in self.layers)
        return replace(self, rope_scaling=scaling, layers=layers)

    def for_context(self, context: int) -> "ModelConfig":
        """This config for a cache of `context` positions: LongRoPE's long factors where it passes the original
        context (transformers switches to them past it, llama.cpp chooses by its context size), else the short
        ones, as read. Keys are cached rotated, so one set serves a whole run. Other ropes: this config."""
        if not self.longrope:
            return self
        original, short, long = self.longrope
        old, new = self.rope_scaling, ("factors", long if context > original else short)
        layers = tuple(replace(layer, rope=replace(layer.rope, scaling=new)) if layer.rope.scaling == old else layer
                       for layer in self.layers)
        return replace(self, rope_scaling=new, layers=layers)

    def rope_note(self, context: int) -> str | None:
        """Which LongRoPE factors for_context(context) takes, and why, in a short line; None for other ropes."""
        if not self.longrope:
            return None
        original = self.longrope[0]
        if context > original:
            return f"LongRoPE long factors: a context of {context:,} tokens, past the original {original:,}"
        return f"LongRoPE short factors: a context of {context:,} tokens, within the original {original:,}"

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json", names: dict[str, str] | None = None) -> "ModelConfig":
        """From config.json's fields; a missing, mistyped or absurd field is a one-line ModelLoadError naming it
        (in `names`' words where given: a GGUF's keys) and its source."""
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{source} holds a JSON {type(cfg).__name__}, not an object of model settings: "
                                 f"the model folder is damaged")
        cfg, names = _text_config(dict(cfg)), names or {}
        for key in _REQUIRED_INTS:
            _whole(cfg, key, True, source, names)
        for key in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
            _whole(cfg, key, False, source, names)
        try:
            return cls._from_checked(cfg, source, names)
        except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as exc:
            raise ModelLoadError(f"{source} has an unusable value ({type(exc).__name__}: {exc}): check its rope and "
                                 f"norm settings") from None

    @classmethod
    def _from_checked(cls, cfg: dict, source: str, names: dict[str, str]) -> "ModelConfig":
        mt = cfg.get("model_type")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // heads
        _check_numbers({**cfg, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6), "head_dim": head_dim}, source, names)
        fam = family(mt, source)
        ropes = _ropes(cfg, head_dim, source, names)
        theta, scaling = ropes.full.theta, ropes.full.scaling
        described = fam.describe(cfg, cfg["num_hidden_layers"], head_dim, ropes)
        layers = described.layers
        return cls(
            model_type=mt,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=any(layer.qkv_bias for layer in layers),
            o_bias=any(layer.o_bias for layer in layers),
            mlp_bias=any(layer.mlp_bias for layer in layers),
            embed_scale=described.embed_scale,
            final_softcap=described.final_softcap,
            layers=layers,
            longrope=_longrope_sets(cfg),
            per_layer_input=described.per_layer_input,
            per_layer_vocab=described.per_layer_vocab,
        )

    @classmethod
    def from_gguf(cls, gf) -> "ModelConfig":
        """From a GGUF's header, its numbers checked against every tensor's shape (check_weight_shapes). gf: a
        GGUFModel, or a container GGUFFile (read as one: an architecture kvchat does not run is refused here)."""
        from kvchat.engine.model.gguf_view import GGUFModel
        gf = GGUFModel.of(gf)
        cfg = cls.from_hf(gf.hf_config(), gf.path.name, gf.key_names())
        factors = gf.rope_factors() if gf.arch != "gemma4" else None    # Gemma 4's: its proportional rope, read
        if factors is not None:
            if len(factors) != cfg.head_dim // 2:
                raise ModelLoadError(f"{gf.path.name}: rope_freqs has {len(factors)} entries, expected {cfg.head_dim // 2}")
            if not all(math.isfinite(f) and f > 0 for f in factors):
                raise ModelLoadError(f"{gf.path.name}: rope_freqs holds a divisor that is 0, negative or not finite: "
                                     f"the file is damaged; re-download or re-convert it")
            cfg = cfg.with_rope_scaling(("factors", factors))
        check_weight_shapes(cfg, gf.hf_shapes(), gf.path.name, gf.key_names(), gf.gguf_name, stored_order=True)
        tokens = gf.fields.get("tokenizer.ggml.tokens")
        if tokens is not None and len(tokens) > cfg.vocab_size:
            raise ModelLoadError(f"{gf.path.name}: the tokenizer has {len(tokens):,} tokens but token_embd.weight only "
                                 f"{cfg.vocab_size:,} rows, so some ids have no embedding: the file is damaged; "
                                 f"re-download or re-convert it")
        return cfg

    def inv_freq(self, layer: int | None = None):
        """[head_dim/2] float32 rotary frequencies (a torch tensor) of the model's rope, or of layer `layer`'s."""
        import torch
        return torch.from_numpy(self.rope_frequencies(layer))

    def rope_frequencies(self, layer: int | None = None) -> np.ndarray:
        """inv_freq() as a numpy array (Rope.table: float64, rounded to float32 once; a partial rotation's
        passed-through pairs at frequency 0, its dimensions in Rope.permutation's order)."""
        rope = self.rope if layer is None else self.layers[layer].rope
        return rope.table(self.head_dim if layer is None else self.layer_head_dim(layer))

    def layer_head_dim(self, layer: int) -> int:
        """Layer `layer`'s head size (LayerSpec.head_dim, else the model's)."""
        return self.layers[layer].head_dim or self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        """Layer `layer`'s KV head count (LayerSpec.kv_heads, else the model's)."""
        return self.layers[layer].kv_heads or self.num_kv_heads

    @property
    def kv_sources(self) -> dict[int, int]:
        """Layer -> the layer whose K and V it attends over, for the layers that keep none of their own."""
        return {i: spec.kv_source for i, spec in enumerate(self.layers) if spec.kv_source is not None}

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The layers that keep a recurrent state instead of a KV cache (LayerSpec.linear), in order."""
        return tuple(i for i, spec in enumerate(self.layers) if spec.linear is not None)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with a KV cache of their own, in order (not a linear-attention layer, nor one that reads
        another layer's KV: LayerSpec.own_kv)."""
        return tuple(i for i, spec in enumerate(self.layers) if spec.own_kv)

    def state_bytes(self) -> int:
        """One conversation's recurrent state over every linear-attention layer (float32), the same at any length."""
        return sum(spec.linear.state_bytes for spec in self.layers if spec.linear is not None)


def _text_config(cfg: dict) -> dict:
    """A multimodal folder's language model: Qwen3.5's published folders (model_type qwen3_5 / qwen3_5_moe) hold
    it under text_config; its own fields win, and a mixture of experts without a dense intermediate_size takes its
    experts' (the field only sizes a dense MLP, which such a model does not have)."""
    text = cfg.get("text_config")
    if cfg.get("model_type") in ("qwen3_5", "qwen3_5_moe", "gemma4") and isinstance(text, dict):
        cfg = {**{k: v for k, v in cfg.items() if k != "text_config"}, **text,
               "model_type": cfg["model_type"] + "_text"}
    if cfg.get("intermediate_size") is None and cfg.get("moe_intermediate_size") is not None:
        cfg["intermediate_size"] = cfg["moe_intermediate_size"]
    return cfg


_REQUIRED_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def _whole(cfg: dict, key: str, required: bool, source: str, names: dict[str, str]) -> None:
    """cfg[key] must be a positive whole number (absent or null allowed when not required)."""
    value = cfg.get(key)
    if value is None:
        if required:
            raise ModelLoadError(f"{source} lacks {names.get(key, key)!r}: the model is incomplete or not a "
                                 f"Llama-family model")
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"{source} has {names.get(key, key)}={value!r}: it must be a positive whole number")


def _ropes(cfg: dict, head_dim: int, source: str, names: dict[str, str]) -> Ropes:
    """The rotary settings of config.json in either spelling: rope_parameters (transformers 5; Gemma 3's keyed by
    layer type, "full_attention" / "sliding_attention"), or rope_theta + rope_scaling (older files; Gemma 3's
    sliding layers then at rope_local_base_freq, default 10,000)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelLoadError(f"{source} has rope settings {params!r}: expected an object of rope parameters")
    partial = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise ModelLoadError(f"{source} has partial_rotary_factor={partial!r}: it must be above 0 and at most 1")
    dims = int(head_dim * partial)
    dims = None if dims == head_dim else dims
    if dims is not None and (dims < 2 or dims % 2):
        raise ModelLoadError(f"{source} has partial_rotary_factor={partial!r}: it rotates {dims} of {head_dim} "
                             f"dimensions, which must be a positive even number")
    if "full_attention" in params or "sliding_attention" in params:
        full, factor = _rope(params.get("full_attention") or {}, cfg.get("rope_theta", 1_000_000.0), cfg, dims,
                             source, names)
        sliding, _ = _rope(params.get("sliding_attention") or {}, cfg.get("rope_local_base_freq", 10000.0), cfg,
                           dims, source, names)
        return Ropes(full, sliding, factor)
    full, factor = _rope(params, cfg.get("rope_theta", 10000.0), cfg, dims, source, names)
    local = cfg.get("rope_local_base_freq")
    sliding = full if local is None else _rope({}, local, cfg, dims, source, names)[0]
    return Ropes(full, sliding, factor)


def _rope(params: dict, theta, cfg: dict, dims: int | None, source: str,
          names: dict[str, str]) -> tuple[Rope, float]:
    """One rope_parameters object -> (Rope, LongRoPE's attention factor, 1.0 for the other kinds)."""
    theta = params.get("rope_theta", theta)
    _check_numbers({"rope_theta": theta}, source, names)
    if "factor" in params:
        _check_numbers({"rope_scaling.factor": params["factor"]}, source, names)
    rtype = params.get("rope_type", params.get("type", "default")) or "default"
    attention_factor = 1.0
    if rtype == "default":
        scaling = ()
    elif rtype == "linear":
        scaling = ("linear", float(params["factor"]), 0.0, 0.0, 0)
    elif rtype == "llama3":
        scaling = ("llama3", float(params["factor"]), float(params["low_freq_factor"]),
                   float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))
    elif rtype in ("longrope", "su"):
        scaling, attention_factor = _longrope(params, cfg, dims, source)
    elif rtype == "yarn":
        scaling, attention_factor = _yarn(params, cfg, source)
    elif rtype == "proportional":
        fraction = params.get("partial_rotary_factor", 1.0)
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise ModelLoadError(f"{source} has proportional rope partial_rotary_factor={fraction!r}: it must be "
                                 f"from 0 to 1")
        if params.get("factor", 1.0) != 1.0:
            raise ModelLoadError(f"{source} has proportional rope with factor={params['factor']!r}: kvchat runs it "
                                 f"unscaled (factor 1)")
        scaling = ("proportional", float(fraction))
    else:
        raise ModelLoadError(f"unsupported rope scaling {rtype!r}: kvchat supports default, linear, llama3, yarn, "
                             f"longrope and proportional")
    return Rope(float(theta), scaling, dims), attention_factor


def _longrope(params: dict, cfg: dict, dims: int | None, source: str) -> tuple[tuple, float]:
    """LongRoPE as ("factors", short_factor) (ModelConfig.for_context takes the long ones for a longer context) and
    its attention factor: as given, else sqrt(1 + ln(s) / ln(original)) for s = max_position_embeddings / original
    (1 if s <= 1)."""
    original = params.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    short = params.get("short_factor")
    half = (dims or cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]) // 2
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ModelLoadError(f"{source} has longrope scaling without a positive original_max_position_embeddings "
                             f"({original!r}): the model's settings are damaged")
    for key in ("short_factor", "long_factor"):
        value = params.get(key)
        if not isinstance(value, list) or len(value) != half or not all(
                not isinstance(f, bool) and isinstance(f, (int, float)) and 0 < f < math.inf for f in value):
            raise ModelLoadError(f"{source} has longrope {key} {_brief(value)}: expected {half} finite numbers "
                                 f"above 0 (one per rotated frequency)")
    attention = params.get("attention_factor")
    if attention is None:
        factor = params.get("factor") or cfg.get("max_position_embeddings", original) / original
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    if isinstance(attention, bool) or not isinstance(attention, (int, float)) or not 0 < attention < math.inf:
        raise ModelLoadError(f"{source} has longrope attention_factor={attention!r}: it must be a finite number "
                             f"above 0")
    return ("factors", tuple(float(f) for f in short)), float(attention)


def _yarn(params: dict, cfg: dict, source: str) -> tuple[tuple, float]:
    """YaRN as ("yarn", factor, beta_fast, beta_slow, original, truncate) and its attention factor: as given, else
    0.1 ln(factor) + 1 (or the mscale / mscale_all_dim ratio where both are given), as transformers reads them."""
    original = params.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ModelLoadError(f"{source} has yarn rope scaling without a positive original_max_position_embeddings "
                             f"({original!r}): the model's settings are damaged")
    factor = params.get("factor") or cfg.get("max_position_embeddings", original) / original
    values = {"factor": factor, "beta_fast": params.get("beta_fast") or 32.0, "beta_slow": params.get("beta_slow") or 1.0}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ModelLoadError(f"{source} has yarn {key}={value!r}: it must be a finite number above 0")
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = (yarn_attention_factor(factor) if not (mscale and mscale_all) else
                     (1.0 if factor <= 1 else (0.1 * mscale * math.log(factor) + 1) /
                      (0.1 * mscale_all * math.log(factor) + 1)))
    if isinstance(attention, bool) or not isinstance(attention, (int, float)) or not 0 < attention < math.inf:
        raise ModelLoadError(f"{source} has yarn attention_factor={attention!r}: it must be a finite number above 0")
    truncate = bool(params.get("truncate", True))
    return ("yarn", float(factor), float(values["beta_fast"]), float(values["beta_slow"]), int(original),
            truncate), float(attention)


def _longrope_sets(cfg: dict) -> tuple:
    """LongRoPE's (original context, short factors, long factors) of a config _ropes accepted; () for other ropes."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type")) not in ("longrope", "su"):
        return ()
    original = params.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    return int(original), tuple(map(float, params["short_factor"])), tuple(map(float, params["long_factor"]))


def _brief(value) -> str:
    return f"of {len(value)} entries" if isinstance(value, list) else repr(value)


# The most of each that kvchat runs: several times the largest open models (Llama 3.1 405B: 126 layers, 128 heads,
# hidden 16384, intermediate 53248; head_dim 256 at most; Gemma 3's 262k vocabulary; contexts of 10M tokens), so
# no real model is refused, while a damaged header cannot make the estimate or the cache loop over 10^9 layers
LIMITS = {"num_hidden_layers": 1024, "num_attention_heads": 1024, "num_key_value_heads": 1024, "head_dim": 1024,
          "hidden_size": 2**16, "intermediate_size": 2**20, "vocab_size": 2**22, "max_position_embeddings": 2**24}
_POSITIVE_REALS = ("rms_norm_eps", "rope_theta", "rope_scaling.factor")


def _check_numbers(values: dict, source: str, names: dict[str, str]) -> None:
    """The whole numbers within 1..LIMITS, eps, theta and a rope factor finite and above 0: else a one-line error."""
    for key, top in LIMITS.items():
        value = values.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"{source} has {names.get(key, key)}={value!r}: it must be a positive whole number")
        if value > top:
            raise ModelLoadError(f"{source} has {names.get(key, key)}={value:,}, past the {top:,} kvchat runs: the "
                                 f"model's settings are damaged; re-download or re-export it")
    for key in _POSITIVE_REALS:
        if key not in values:
            continue
        value = values[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ModelLoadError(f"{source} has {names.get(key, key)}={value!r}: it must be a finite number above 0; "
                                 f"the model's settings are damaged")


# ---- the weights' shapes against the config -----------------------------------------------------------

_Dim = tuple[int, tuple[str, ...]]       # a length, and the config fields whose product it is


def layer_modules(mc: ModelConfig, spec: LayerSpec) -> dict[str, tuple[str, ...]]:
    """A layer's Hugging Face modules (under model.layers.{i}.) by the part of the Layer each makes: qkv, o,
    gate_up and down (several modules: concatenated along the output, in this order) and the norms the spec asks
    for. Llama's post_attention_layernorm is the norm before the MLP; Gemma's is the one after attention, its
    MLP's pre_feedforward_layernorm. Phi-3 stores q|k|v and gate|up already fused."""
    fam = family_of(mc.model_type)
    fused = fam is not None and fam.fused_projections
    if spec.linear is not None:         # linear attention: one fused input projection, out_proj, the mixer's vectors
        modules = {"qkv": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                           "linear_attn.in_proj_a"),
                   "o": ("linear_attn.out_proj",), "norm_attn": ("input_layernorm",),
                   "norm_mlp": ("post_attention_layernorm",), "conv": ("linear_attn.conv1d",),
                   "dt": ("linear_attn.dt",), "A": ("linear_attn.A",), "mixer_norm": ("linear_attn.norm",),
                   "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
        return _mlp_modules(modules, spec)
    if fused:
        qkv = ("self_attn.qkv_proj",)
    elif spec.kv_source is not None:            # another layer's K and V: q only
        qkv = ("self_attn.q_proj",)
    elif spec.value_from_key:                   # v is k_proj's output
        qkv = ("self_attn.q_proj", "self_attn.k_proj")
    else:
        qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    modules = {"qkv": qkv,
               "o": ("self_attn.o_proj",),
               "gate_up": ("mlp.gate_up_proj",) if fused else ("mlp.gate_proj", "mlp.up_proj"),
               "down": ("mlp.down_proj",), "norm_attn": ("input_layernorm",)}
    _mlp_modules(modules, spec)
    if spec.sink_logits:
        modules["sinks"] = ("self_attn.sinks",)
    if spec.post_norms:
        modules.update(post_attn_norm=("post_attention_layernorm",), norm_mlp=("pre_feedforward_layernorm",),
                       post_mlp_norm=("post_feedforward_layernorm",))
    else:
        modules["norm_mlp"] = ("post_attention_layernorm",)
    if spec.qk_norm:
        modules["q_norm"] = ("self_attn.q_norm",)
        if spec.kv_source is None:
            modules["k_norm"] = ("self_attn.k_norm",)
    if mc.per_layer_input:                      # per-layer input embeddings: a gate, a projection and its norm
        modules.update(ple_gate=("per_layer_input_gate",), ple_proj=("per_layer_projection",),
                       ple_norm=("post_per_layer_input_norm",))
    if spec.output_scale:
        modules["scalar"] = ("layer_scalar",)
    return modules


def _mlp_modules(modules: dict, spec: LayerSpec) -> dict:
    """A routed MLP's modules in place of the dense gate_up / down: the router and the experts' 3-D matrices
    (families.EXPERT_TENSORS), and a shared expert with its gate where the description has one."""
    if spec.experts is not None:
        if spec.experts.beside_dense:       # Gemma 4: the dense MLP stays; the experts' own norms and router scales
            modules.update(post_mlp_norm_1=("post_feedforward_layernorm_1",),
                           norm_mlp_2=("pre_feedforward_layernorm_2",),
                           post_mlp_norm_2=("post_feedforward_layernorm_2",))
        else:
            modules.pop("gate_up", None), modules.pop("down", None)
        modules.update(router=("mlp.router",), experts_gate=("mlp.experts.gate_proj",),
                       experts_up=("mlp.experts.up_proj",), experts_down=("mlp.experts.down_proj",))
        if spec.experts.shared_ffn:
            modules.update(shared_gate_up=("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
                           shared_down=("mlp.shared_expert.down_proj",), shared_gate=("mlp.shared_expert_gate",))
    return modules


def expected_shapes(mc: ModelConfig) -> dict[str, tuple[tuple[_Dim, ...], bool]]:
    """Every weight a model of this config reads: Hugging Face name -> ([out, in] shape, required)."""
    h, f = (mc.hidden_size, ("hidden_size",)), (mc.intermediate_size, ("intermediate_size",))
    v = (mc.vocab_size, ("vocab_size",))
    q = (mc.num_heads * mc.head_dim, ("num_attention_heads", "head_dim"))
    kv = (mc.num_kv_heads * mc.head_dim, ("num_key_value_heads", "head_dim"))
    rows = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv, "self_attn.o_proj": h,
            "self_attn.qkv_proj": ((mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim,
                                   ("(num_attention_heads + 2 x num_key_value_heads)", "head_dim")),
            "mlp.gate_proj": f, "mlp.up_proj": f,
            "mlp.gate_up_proj": (2 * mc.intermediate_size, ("2", "intermediate_size")),
            "mlp.down_proj": h}
    out = {"model.embed_tokens.weight": ((v, h), True), "model.norm.weight": ((h,), True),
           "lm_head.weight": ((v, h), False)}         # absent: tied to the embedding
    if mc.per_layer_input:
        lp = (mc.num_layers * mc.per_layer_input, ("num_hidden_layers", "hidden_size_per_layer_input"))
        out.update({"model.embed_tokens_per_layer.weight": (((mc.per_layer_vocab, ("vocab_size_per_layer_input",)),
                                                             lp), True),
                    "model.per_layer_model_projection.weight": ((lp, h), True),
                    "model.per_layer_projection_norm.weight": (((mc.per_layer_input,
                                                                 ("hidden_size_per_layer_input",)),), True)})
    for i, spec in enumerate(mc.layers):
        p = f"model.layers.{i}."
        if spec.linear is not None:
            out.update(linear_shapes(p, spec, h))
            if spec.experts is not None:
                out.update(expert_shapes(p, spec.experts, h))
            else:
                out.update({p + "mlp.gate_proj.weight": ((f, h), True), p + "mlp.up_proj.weight": ((f, h), True),
                            p + "mlp.down_proj.weight": ((h, f), True)})
            continue
        out.update(attention_shapes(mc, i, spec, p, rows, h, f))
    return out


def attention_shapes(mc: ModelConfig, i: int, spec: LayerSpec, p: str, rows: dict, h: _Dim, f: _Dim) -> dict:
    """A softmax-attention layer's tensors under layer prefix p, at its own head size, KV heads and MLP width."""
    out = {}
    if spec.head_dim or spec.kv_heads:
        hd, kvh = mc.layer_head_dim(i), mc.layer_kv_heads(i)
        dkey = ("head_dim of the layer",) if spec.head_dim else ("head_dim",)
        hkey = ("KV heads of the layer",) if spec.kv_heads else ("num_key_value_heads",)
        q = (mc.num_heads * hd, ("num_attention_heads",) + dkey)
        kv = (kvh * hd, hkey + dkey)
        rows = {**rows, "self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv}
    q, d = rows["self_attn.q_proj"], (mc.layer_head_dim(i), ("head_dim",))
    if spec.ffn:
        f = (spec.ffn, ("2", "intermediate_size"))
        rows = {**rows, "mlp.gate_proj": f, "mlp.up_proj": f}
    if spec.attn_gate:              # q_proj gives each head's query and its output gate
        rows = {**rows, "self_attn.q_proj": (2 * mc.num_heads * mc.head_dim,
                                             ("2", "num_attention_heads", "head_dim"))}
        q = (mc.num_heads * mc.head_dim, ("num_attention_heads", "head_dim"))
    modules = layer_modules(mc, spec)
    biased = {"qkv": spec.qkv_bias, "o": spec.o_bias, "gate_up": spec.mlp_bias, "down": spec.mlp_bias}
    dense = [part for part in ("qkv", "o", "gate_up", "down") if part in modules]
    for part in dense:
        for name in modules[part]:
            out[p + name + ".weight"] = ((rows[name], q if part == "o" else f if part == "down" else h), True)
    if mc.per_layer_input:
        e = (mc.per_layer_input, ("hidden_size_per_layer_input",))
        out.update({p + "per_layer_input_gate.weight": ((e, h), True),
                    p + "per_layer_projection.weight": ((h, e), True)})
    for part, names in modules.items():
        if part in biased or part.startswith(("router", "experts", "sinks", "shared")) or part in ("ple_gate",
                                                                                                  "ple_proj"):
            continue
        if part == "scalar":
            out[p + names[0]] = (((1, ("1",)),), True)
            continue
        out[p + names[0] + ".weight"] = ((d if part in ("q_norm", "k_norm") else h,), True)
    for part in dense:
        if biased[part]:
            for name in modules[part]:
                out[p + name + ".bias"] = ((rows[name],), True)
    if spec.sink_logits:
        out[p + "self_attn.sinks.weight"] = (((mc.num_heads, ("num_attention_heads",)),), True)
    if spec.experts is not None:
        out.update(expert_shapes(p, spec.experts, h))
    return out


def linear_shapes(p: str, spec: LayerSpec, h: _Dim) -> dict:
    """A linear-attention layer's mixer and norms under layer prefix p (layer_modules names them)."""
    la = spec.linear
    c = (la.channels, ("2 x linear_num_key_heads x linear_key_head_dim + linear_num_value_heads x "
                       "linear_value_head_dim",))
    vd = (la.value_heads * la.value_dim, ("linear_num_value_heads", "linear_value_head_dim"))
    vh = (la.value_heads, ("linear_num_value_heads",))
    f = p + "linear_attn."
    out = {f + "in_proj_qkv.weight": ((c, h), True), f + "in_proj_z.weight": ((vd, h), True),
           f + "in_proj_b.weight": ((vh, h), True), f + "in_proj_a.weight": ((vh, h), True),
           f + "out_proj.weight": ((h, vd), True),
           f + "conv1d.weight": ((c, (la.conv_kernel, ("linear_conv_kernel_dim",))), True),
           f + "dt.bias": ((vh,), True), f + "A.weight": ((vh,), True),
           f + "norm.weight": (((la.value_dim, ("linear_value_head_dim",)),), True),
           p + "input_layernorm.weight": ((h,), True), p + "post_attention_layernorm.weight": ((h,), True)}
    return out


def expert_shapes(p: str, ex, h: _Dim) -> dict:
    """A routed MLP's tensors under layer prefix p: the router [experts, hidden], each expert matrix [experts, out,
    in], and their biases where the description has them."""
    e, fe = (ex.count, ("num_experts",)), (ex.ffn, ("moe_intermediate_size",))
    out = {p + "mlp.router.weight": ((e, h), True),
           p + "mlp.experts.gate_proj.weight": ((e, fe, h), True),
           p + "mlp.experts.up_proj.weight": ((e, fe, h), True),
           p + "mlp.experts.down_proj.weight": ((e, h, fe), True)}
    if ex.router_bias:
        out[p + "mlp.router.bias"] = ((e,), True)
    if ex.beside_dense:                     # the router's input scale [hidden] and each expert's scale
        out.update({p + "mlp.router.scale": ((h,), True), p + "mlp.router.per_expert_scale": ((e,), True)})
    if ex.shared_ffn:
        fs = (ex.shared_ffn, ("shared_expert_intermediate_size",))
        out.update({p + "mlp.shared_expert.gate_proj.weight": ((fs, h), True),
                    p + "mlp.shared_expert.up_proj.weight": ((fs, h), True),
                    p + "mlp.shared_expert.down_proj.weight": ((h, fs), True),
                    p + "mlp.shared_expert_gate.weight": (((1, ("1",)), h), True)})
    if ex.expert_bias:
        out.update({p + "mlp.experts.gate_proj.bias": ((e, fe), True), p + "mlp.experts.up_proj.bias": ((e, fe), True),
                    p + "mlp.experts.down_proj.bias": ((e, h), True)})
    return out


def check_weight_shapes(mc: ModelConfig, shapes: dict[str, tuple[int, ...]], source: str, names: dict[str, str],
                        rename=None, stored_order: bool = False) -> None:
    """The one check of a model's weights against its config, for every loader, before anything is packed:
    shapes (Hugging Face name -> [out, in]) must hold the config's layers and every tensor in its expected shape.
    A mismatch is a one-line ModelLoadError naming the tensor (rename: in the source's words), both shapes
    (stored_order: reversed, as a GGUF lists them) and the fields (names: in the source's words)."""
    name_of = rename or (lambda n: n)
    field = lambda key: names.get(key, key)       # noqa: E731
    layer_ids = {int(n.split(".")[2]) for n in shapes if n.startswith("model.layers.") and n.split(".")[2].isdigit()}
    found = max(layer_ids) + 1 if layer_ids else 0
    if found != mc.num_layers or len(layer_ids) != found:
        raise ModelLoadError(f"{field('num_hidden_layers')}={mc.num_layers} in {source}, but the weights hold "
                             f"{len(layer_ids)} layers: the config does not match its weights")
    expected = expected_shapes(mc)
    attention = {n: e for n, e in expected.items() if ".self_attn." in n}
    # hidden, vocabulary and intermediate first: a wrong hidden size must not read as a wrong head count
    _check_each({n: e for n, e in expected.items() if n not in attention}, shapes, source, name_of, field, stored_order)
    for key, proj, heads in (("num_key_value_heads", "k_proj", mc.num_kv_heads), ("num_attention_heads", "q_proj", mc.num_heads)):
        rows = (shapes.get(f"model.layers.0.self_attn.{proj}.weight") or (None,))[0]
        if rows is not None and rows != heads * mc.head_dim:
            raise ModelLoadError(f"{field(key)}={heads} in {source}, but the weights hold {rows // mc.head_dim} "
                                 f"heads ({rows} rows of head_dim {mc.head_dim}): the config does not match its weights")
    _check_each(attention, shapes, source, name_of, field, stored_order)


def _check_each(expected: dict, shapes: dict, source: str, name_of, field, stored_order: bool) -> None:
    order = (lambda t: tuple(reversed(t))) if stored_order else tuple
    for name, (dims, required) in expected.items():
        got = shapes.get(name)
        if got is None:
            if required:
                raise ModelLoadError(f"{source} lacks the tensor {name_of(name)}: the model is incomplete or not "
                                     f"the architecture its settings name")
            continue
        want = tuple(n for n, _ in dims)
        if tuple(got) != want:
            why = ", ".join(" x ".join(field(k) for k in keys) for _, keys in order(dims))
            raise ModelLoadError(f"{source}: tensor {name_of(name)} has shape {list(order(got))}, but the model's "
                                 f"settings make it {list(order(want))} ({why}): the settings do not match the "
                                 f"weights; re-download or re-export the model")


# attention(layer, q [T, Hq, D], k [T, Hkv, D] before RoPE, v [T, Hkv, D]) -> [T, Hq, D]
