"""A model's shape and settings (ModelConfig), read from config.json or a GGUF's metadata; no torch here.

The shape is flat fields; what each layer computes is `layers`, one LayerSpec per layer (engine/model/spec.py),
which the family registry (engine/model/families.py) builds from the same fields.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from engine.errors import ModelLoadError
from engine.model.families import family
from engine.model.spec import LayerSpec, Rope


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
        the model's rope and one query scale (the step takes one cos / sin table and one scale for all layers),
        unscaled embeddings and uncapped logits. The weights' packing is the linears' to say."""
        first = self.layers[0]
        return (self.embed_scale == 1.0 and self.final_softcap is None
                and all(layer.fused_kernel_ok and layer.rope == self.rope and layer.query_scale == first.query_scale
                        for layer in self.layers))

    def with_rope_scaling(self, scaling: tuple) -> "ModelConfig":
        """This config with the model's rope scaling replaced, in every layer that used the model's rope."""
        old, new = self.rope, Rope(self.rope_theta, scaling)
        layers = tuple(replace(layer, rope=new) if layer.rope == old else layer for layer in self.layers)
        return replace(self, rope_scaling=scaling, layers=layers)

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json", names: dict[str, str] | None = None) -> "ModelConfig":
        """From config.json's fields; a missing, mistyped or absurd field is a one-line ModelLoadError naming it
        (in `names`' words where given: a GGUF's keys) and its source."""
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{source} holds a JSON {type(cfg).__name__}, not an object of model settings: "
                                 f"the model folder is damaged")
        cfg, names = dict(cfg), names or {}
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
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        _check_numbers({**cfg, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6), "rope_theta": theta,
                        "head_dim": cfg.get("head_dim") or hidden // heads}, source, names)
        if isinstance(rope, dict) and "factor" in rope:
            _check_numbers({"rope_scaling.factor": rope["factor"]}, source, names)
        rtype = rope.get("rope_type", rope.get("type", "default")) or "default"
        if rtype == "default":
            scaling = ()
        elif rtype == "linear":
            scaling = ("linear", float(rope["factor"]), 0.0, 0.0, 0)
        elif rtype == "llama3":
            scaling = ("llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
                       float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
        else:
            raise ModelLoadError(f"unsupported rope scaling {rtype!r}: kvchat supports default, linear and llama3")
        head_dim = cfg.get("head_dim") or hidden // heads
        described = family(mt, source).describe(cfg, cfg["num_hidden_layers"], head_dim, Rope(float(theta), scaling))
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
        )

    @classmethod
    def from_gguf(cls, gf) -> "ModelConfig":
        """From a GGUF's header, its numbers checked against every tensor's shape (check_weight_shapes)."""
        cfg = cls.from_hf(gf.hf_config(), gf.path.name, gf.key_names())
        factors = gf.rope_factors()
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
        """inv_freq() as a numpy array (Rope.frequencies: float64, rounded to float32 once)."""
        rope = self.rope if layer is None else self.layers[layer].rope
        return rope.frequencies(self.head_dim)


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


def expected_shapes(mc: ModelConfig) -> dict[str, tuple[tuple[_Dim, ...], bool]]:
    """Every weight a model of this config reads: Hugging Face name -> ([out, in] shape, required)."""
    h, f = (mc.hidden_size, ("hidden_size",)), (mc.intermediate_size, ("intermediate_size",))
    v = (mc.vocab_size, ("vocab_size",))
    q = (mc.num_heads * mc.head_dim, ("num_attention_heads", "head_dim"))
    kv = (mc.num_kv_heads * mc.head_dim, ("num_key_value_heads", "head_dim"))
    out = {"model.embed_tokens.weight": ((v, h), True), "model.norm.weight": ((h,), True),
           "lm_head.weight": ((v, h), False)}         # absent: tied to the embedding
    for i, spec in enumerate(mc.layers):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)), ("self_attn.v_proj", (kv, h)),
                            ("self_attn.o_proj", (h, q)), ("mlp.gate_proj", (f, h)), ("mlp.up_proj", (f, h)),
                            ("mlp.down_proj", (h, f)), ("input_layernorm", (h,)), ("post_attention_layernorm", (h,))):
            out[p + name + ".weight"] = (shape, True)
        for on, name, shape in ((spec.qkv_bias, "self_attn.q_proj", q), (spec.qkv_bias, "self_attn.k_proj", kv),
                                (spec.qkv_bias, "self_attn.v_proj", kv), (spec.o_bias, "self_attn.o_proj", h),
                                (spec.mlp_bias, "mlp.gate_proj", f), (spec.mlp_bias, "mlp.up_proj", f),
                                (spec.mlp_bias, "mlp.down_proj", h)):
            if on:
                out[p + name + ".bias"] = ((shape,), True)
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
                raise ModelLoadError(f"{source} lacks the tensor {name_of(name)}: the model is incomplete or not a "
                                     f"Llama-family model")
            continue
        want = tuple(n for n, _ in dims)
        if tuple(got) != want:
            why = ", ".join(" x ".join(field(k) for k in keys) for _, keys in order(dims))
            raise ModelLoadError(f"{source}: tensor {name_of(name)} has shape {list(order(got))}, but the model's "
                                 f"settings make it {list(order(want))} ({why}): the settings do not match the "
                                 f"weights; re-download or re-export the model")


# attention(layer, q [T, Hq, D], k [T, Hkv, D] before RoPE, v [T, Hkv, D]) -> [T, Hq, D]
