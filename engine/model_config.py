"""A model's shape and settings (ModelConfig), read from config.json or a GGUF's metadata; no torch here."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .loader import ModelLoadError


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
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads={self.num_heads} is not a multiple of "
                                 f"num_key_value_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """From config.json's fields; a missing or mistyped field is a one-line ModelLoadError naming it."""
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"config.json holds a JSON {type(cfg).__name__}, not an object of model settings: "
                                 f"the model folder is damaged")
        cfg = dict(cfg)
        for key in _REQUIRED_INTS:
            _whole(cfg, key, required=True)
        for key in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
            _whole(cfg, key, required=False)
        try:
            return cls._from_checked(cfg)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ModelLoadError(f"config.json has an unusable value ({type(exc).__name__}: {exc}): check its rope and norm settings") from None

    @classmethod
    def _from_checked(cls, cfg: dict) -> "ModelConfig":
        mt = cfg.get("model_type")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
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
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=mt == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=mt != "qwen2" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
        )

    @classmethod
    def from_gguf(cls, gf) -> "ModelConfig":
        cfg = cls.from_hf(gf.hf_config())
        factors = gf.rope_factors()
        if factors is not None:
            if len(factors) != cfg.head_dim // 2:
                raise ModelLoadError(f"{gf.path.name}: rope_freqs has {len(factors)} entries, expected {cfg.head_dim // 2}")
            from dataclasses import replace
            cfg = replace(cfg, rope_scaling=("factors", factors))
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


def _whole(cfg: dict, key: str, required: bool) -> None:
    """cfg[key] must be a positive whole number (absent or null allowed when not required)."""
    value = cfg.get(key)
    if value is None:
        if required:
            raise ModelLoadError(f"config.json lacks {key!r}: the model folder is incomplete or not a Llama-family model")
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"config.json has {key}={value!r}: it must be a positive whole number")


# attention(layer, q [T, Hq, D], k [T, Hkv, D] before RoPE, v [T, Hkv, D]) -> [T, Hq, D]
