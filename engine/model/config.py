"""A model's shape and settings (ModelConfig), read from config.json or a GGUF's metadata; no torch here."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.errors import ModelLoadError
@dataclass(frozen=True, slots=True)
class ModelConfig:
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
        return cls(
            model_type=mt,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=mt == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=mt != "qwen2" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
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
            from dataclasses import replace
            cfg = replace(cfg, rope_scaling=("factors", factors))
        check_weight_shapes(cfg, gf.hf_shapes(), gf.path.name, gf.key_names(), gf.gguf_name, stored_order=True)
        tokens = gf.fields.get("tokenizer.ggml.tokens")
        if tokens is not None and len(tokens) > cfg.vocab_size:
            raise ModelLoadError(f"{gf.path.name}: the tokenizer has {len(tokens):,} tokens but token_embd.weight only "
                                 f"{cfg.vocab_size:,} rows, so some ids have no embedding: the file is damaged; "
                                 f"re-download or re-convert it")
        return cfg

    def inv_freq(self):
        """[head_dim/2] float32 rotary frequencies (a torch tensor), with llama3 / linear scaling applied."""
        import torch
        return torch.from_numpy(self.rope_frequencies())

    def rope_frequencies(self) -> np.ndarray:
        """inv_freq() as a numpy array: computed in float64, rounded to float32 once."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        if self.rope_scaling:
            kind, factor = self.rope_scaling[:2]
            if kind == "linear":
                inv = inv / factor
            elif kind == "factors":     # a GGUF's rope_freqs tensor: one divisor per frequency
                inv = inv / np.asarray(factor, dtype=np.float64)
            else:  # llama3: long wavelengths slowed by `factor`, short kept, smooth in between
                low, high, orig = self.rope_scaling[2:]
                wavelen = 2 * math.pi / inv
                low_wl, high_wl = orig / low, orig / high
                smooth = (orig / wavelen - low) / (high - low)
                scaled = np.where(wavelen > low_wl, inv / factor, inv)
                mid = (wavelen <= low_wl) & (wavelen >= high_wl)
                inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
        return inv.astype(np.float32)


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
    for i in range(mc.num_layers):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)), ("self_attn.v_proj", (kv, h)),
                            ("self_attn.o_proj", (h, q)), ("mlp.gate_proj", (f, h)), ("mlp.up_proj", (f, h)),
                            ("mlp.down_proj", (h, f)), ("input_layernorm", (h,)), ("post_attention_layernorm", (h,))):
            out[p + name + ".weight"] = (shape, True)
        for on, name, shape in ((mc.qkv_bias, "self_attn.q_proj", q), (mc.qkv_bias, "self_attn.k_proj", kv),
                                (mc.qkv_bias, "self_attn.v_proj", kv), (mc.o_bias, "self_attn.o_proj", h),
                                (mc.mlp_bias, "mlp.gate_proj", f), (mc.mlp_bias, "mlp.up_proj", f),
                                (mc.mlp_bias, "mlp.down_proj", h)):
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
