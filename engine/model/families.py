"""The model families kvchat runs: the one registry of architectures.

Each family says which config.json `model_type`s and which GGUF `general.architecture` are its own, how
llama.cpp's converter stored its weights, and how its config fields become the per-layer description
(engine/model/spec.py). Everything that asks "is this architecture supported?" or "what does this
family's layer do?" reads this table: the loaders, the GGUF reader, the estimate and the one-shot path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from engine.errors import ModelLoadError
from engine.model.spec import LayerSpec, Rope


@dataclass(frozen=True, slots=True)
class Description:
    """A family's reading of one config: a spec per layer, and what the model does around them."""
    layers: tuple[LayerSpec, ...]
    embed_scale: float = 1.0                 # the embedding rows are multiplied by this (Gemma: sqrt(hidden))
    final_softcap: float | None = None       # logits become cap * tanh(logits / cap) (Gemma 2); None: not capped


# describe(config.json's fields, layers, head_dim, the model's rope) -> Description
Describe = Callable[[dict, int, int, Rope], Description]


# a layer's Hugging Face module -> llama.cpp's tensor name (blk.{i}.<name>.weight); a family that stores q, k, v or
# gate, up fused (Phi-3: attn_qkv, ffn_up holding gate and up) names its own modules here
LLAMA_TENSORS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


@dataclass(frozen=True, slots=True, eq=False)       # each family is one object: compared as itself
class Family:
    name: str
    model_types: tuple[str, ...]          # config.json's model_type(s); the first is the one a GGUF reads as
    gguf_arch: str                        # a GGUF's general.architecture (also the prefix of its keys)
    gguf_permuted_qk: bool                # llama.cpp's converter interleaved the q / k rows of each head
    describe: Describe
    gguf_tensors: dict[str, str] = field(default_factory=lambda: LLAMA_TENSORS)


def _llama(cfg: dict, n_layers: int, head_dim: int, rope: Rope) -> Description:
    # attention_bias: q, k, v and o together (InternLM-style exports); mlp_bias: gate, up and down. Mistral's
    # sliding_window is not read: kvchat has run its models with full attention (v0.3 and later have none)
    attn = bool(cfg.get("attention_bias", False))
    layer = LayerSpec(rope=rope, query_scale=head_dim ** -0.5, qkv_bias=attn, o_bias=attn,
                      mlp_bias=bool(cfg.get("mlp_bias", False)))
    return Description((layer,) * n_layers)


def _qwen2(cfg: dict, n_layers: int, head_dim: int, rope: Rope) -> Description:
    # q, k and v always carry a bias, o never (Qwen2Attention), whatever attention_bias says
    layer = LayerSpec(rope=rope, query_scale=head_dim ** -0.5, qkv_bias=True,
                      mlp_bias=bool(cfg.get("mlp_bias", False)))
    return Description((layer,) * n_layers)


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",), "llama", True, _llama),
    Family("mistral", ("mistral",), "mistral", False, _llama),
    Family("qwen2", ("qwen2",), "qwen2", False, _qwen2),
)
_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
_BY_GGUF_ARCH = {f.gguf_arch: f for f in FAMILIES}


def supported() -> str:
    """The families by name, for messages: "llama, mistral, qwen2"."""
    return ", ".join(f.name for f in FAMILIES)


def family(model_type: str, where: str) -> Family:
    """The family of a config.json model_type; else a ModelLoadError naming it, `where`, and the supported list."""
    f = _BY_MODEL_TYPE.get(model_type)
    if f is None:
        raise _unsupported(model_type, where)
    return f


def gguf_family(arch: str, where: str) -> Family:
    """The family of a GGUF's general.architecture; else the same ModelLoadError as family()."""
    f = _BY_GGUF_ARCH.get(arch)
    if f is None:
        raise _unsupported(arch, where)
    return f


def _unsupported(name: str, where: str) -> ModelLoadError:
    return ModelLoadError(f"unsupported architecture {name!r} in {where}: kvchat runs the Llama family "
                          f"({supported()})")


def check_architecture(model_type: str, where: str) -> None:
    """A config.json's model_type must be a family's (see family())."""
    family(model_type, where)
