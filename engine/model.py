"""Our own compact Llama-family forward pass (llama, mistral, qwen2) over transformers' weights.

The model never sees the cache layout: each layer hands q, k, v (keys before RoPE) to an
attention callback that owns positions, rotation, the paged cache and the softmax.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

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
    rope_scaling: tuple  # (type, factor, low_freq_factor, high_freq_factor, original_max) or ()
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

    def inv_freq(self) -> torch.Tensor:
        """[head_dim/2] float32 rotary frequencies, with llama3 / linear scaling applied."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        if self.rope_scaling:
            kind, factor, low, high, orig = self.rope_scaling
            if kind == "linear":
                inv = inv / factor
            else:  # llama3: long wavelengths slowed by `factor`, short kept, smooth in between
                wavelen = 2 * math.pi / inv
                low_wl, high_wl = orig / low, orig / high
                smooth = (orig / wavelen - low) / (high - low)
                scaled = torch.where(wavelen > low_wl, inv / factor, inv)
                mid = (wavelen <= low_wl) & (wavelen >= high_wl)
                inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
        return inv.float()


# attention(layer, q [T, Hq, D], k [T, Hkv, D] before RoPE, v [T, Hkv, D]) -> [T, Hq, D]
DECODE_ROWS = 8

Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Layer:
    __slots__ = ("w_qkv", "b_qkv", "w_o", "b_o", "w_gate_up", "b_gate_up", "w_down", "b_down", "norm_attn", "norm_mlp")


class Transformer:
    """Weights as plain tensors; q/k/v and gate/up fused so a decode step runs fewer, larger matmuls.

    weights="int4" adds packed int4 copies (groups of 32, see qlinear.py) of every projection that
    decode steps read instead of the dense weights: a quarter of the bytes per token. Prefill keeps
    the dense weights. Only the matmul inputs drop to bf16; the residual stream keeps the model dtype.
    """

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device: str,
                 weights: str = "dense"):
        self.config = config
        self.weights = weights
        self.dtype = dtype
        self.device = device
        c = config

        def take(name: str, required: bool = True):
            t = state.pop(name, None)
            if t is None:
                if required:
                    raise ModelLoadError(f"weight {name} is missing: the checkpoint does not match its config.json")
                return None
            return t.to(device=device, dtype=dtype)

        def cat(*ts):
            return None if any(t is None for t in ts) else torch.cat(ts, 0).contiguous()

        self.embed = take("model.embed_tokens.weight")
        if self.embed.shape != (c.vocab_size, c.hidden_size):
            raise ModelLoadError(f"embedding shape {tuple(self.embed.shape)} does not match config "
                                 f"({c.vocab_size}, {c.hidden_size})")
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            L = Layer()
            L.w_qkv = cat(take(p + "self_attn.q_proj.weight"), take(p + "self_attn.k_proj.weight"),
                          take(p + "self_attn.v_proj.weight"))
            L.b_qkv = cat(take(p + "self_attn.q_proj.bias", c.qkv_bias), take(p + "self_attn.k_proj.bias", c.qkv_bias),
                          take(p + "self_attn.v_proj.bias", c.qkv_bias)) if c.qkv_bias else None
            L.w_o = take(p + "self_attn.o_proj.weight")
            L.b_o = take(p + "self_attn.o_proj.bias", c.o_bias) if c.o_bias else None
            L.w_gate_up = cat(take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight"))
            L.b_gate_up = cat(take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")) if c.mlp_bias else None
            L.w_down = take(p + "mlp.down_proj.weight")
            L.b_down = take(p + "mlp.down_proj.bias") if c.mlp_bias else None
            L.norm_attn = take(p + "input_layernorm.weight")
            L.norm_mlp = take(p + "post_attention_layernorm.weight")
            self.layers.append(L)
        self.norm = take("model.norm.weight")
        head = state.pop("lm_head.weight", None)
        if c.tie_word_embeddings or head is None:
            self.lm_head = self.embed
        else:
            self.lm_head = head.to(device=device, dtype=dtype)
        self.inv_freq = config.inv_freq().to(device)
        self._linear = {}
        if weights == "int4":
            self._pack_int4()

    def _pack_int4(self) -> None:
        from .qlinear import Int4Linear, can_pack
        for L in self.layers:
            for w_name, b_name in (("w_qkv", "b_qkv"), ("w_o", "b_o"), ("w_gate_up", "b_gate_up"), ("w_down", "b_down")):
                w = getattr(L, w_name)
                if can_pack(w):
                    self._linear[id(w)] = Int4Linear(w, getattr(L, b_name))
        # the output head stays dense: GGUFs usually store it at 8 bits or more (SmolLM2: Q8_0)

    def _mm(self, x: torch.Tensor, w: torch.Tensor, b=None) -> torch.Tensor:
        # decode steps (a few rows) read the packed int4 copy; prefill's large matmuls stay dense,
        # where the packed kernel is slower than the BLAS GEMM
        if x.shape[0] <= DECODE_ROWS and self._linear:
            packed = self._linear.get(id(w))
            if packed is not None:
                return packed(x)
        return F.linear(x, w, b)

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]; statistics in fp32 as the reference does
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, self.config.rms_norm_eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return w * xf.to(self.dtype)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, attention: Attention, all_logits: bool = False) -> torch.Tensor:
        """token_ids: [T] -> logits [T, vocab] (all_logits) or [1, vocab] for the last token, float32."""
        c = self.config
        T = token_ids.shape[0]
        q_size = c.num_heads * c.head_dim
        kv_size = c.num_kv_heads * c.head_dim
        x = self.embed[token_ids]
        for i, L in enumerate(self.layers):
            h = self._rms_norm(x, L.norm_attn)
            qkv = self._mm(h, L.w_qkv, L.b_qkv)
            q = qkv[:, :q_size].view(T, c.num_heads, c.head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(T, c.num_kv_heads, c.head_dim)
            v = qkv[:, q_size + kv_size:].view(T, c.num_kv_heads, c.head_dim)
            o = attention(i, q, k, v)
            x = x + self._mm(o.reshape(T, q_size).to(self.dtype), L.w_o, L.b_o)
            h = self._rms_norm(x, L.norm_mlp)
            gu = self._mm(h, L.w_gate_up, L.b_gate_up)
            gate, up = gu.chunk(2, dim=-1)
            x = x + self._mm(F.silu(gate) * up, L.w_down, L.b_down)
        if not all_logits:
            x = x[-1:]
        x = self._rms_norm(x, self.norm)
        return self._mm(x, self.lm_head).float()

    def weight_bytes(self) -> int:
        seen, total = set(), 0
        for t in [self.embed, self.norm, self.lm_head] + [getattr(L, s) for L in self.layers for s in Layer.__slots__]:
            if t is not None and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total + sum(p.nbytes for p in self._linear.values())

