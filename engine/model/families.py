"""The model families kvchat runs: the one registry of architectures.

Each family says which config.json `model_type`s and which GGUF `general.architecture` are its own, how
llama.cpp's converter stored its weights, and how its config fields become the per-layer description
(engine/model/spec.py). Everything that asks "is this architecture supported?" or "what does this
family's layer do?" reads this table: the loaders, the GGUF view (gguf_view.py), the estimate and the one-shot path.

Past 450 lines on purpose: each family's reading of config.json beside the others', over the same helpers (layer
types, windows, caps, experts), so that a field read one way in one family and another way in the next shows.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from kvchat.engine.errors import ModelLoadError
from kvchat.engine.model.gguf_arch import EXPERT_TENSORS, GEMMA2_TENSORS, GEMMA3_TENSORS, GPT_OSS_TENSORS, PHI3_TENSORS, QWEN3_TENSORS, \
    QWEN3MOE_TENSORS, QWEN35_TENSORS, QWEN35MOE_TENSORS, GEMMA4_TENSORS
from kvchat.engine.model.spec import Experts, LayerSpec, LinearAttention, Rope


@dataclass(frozen=True, slots=True)
class Description:
    """A family's reading of one config: a spec per layer, and what the model does around them."""
    layers: tuple[LayerSpec, ...]
    embed_scale: float = 1.0                 # the embedding rows are multiplied by this (Gemma: sqrt(hidden))
    final_softcap: float | None = None       # logits become cap * tanh(logits / cap) (Gemma 2); None: not capped
    per_layer_input: int = 0                 # per-layer input embeddings' width per layer (Gemma 4 E2B / E4B)
    per_layer_vocab: int = 0                 # their table's rows


@dataclass(frozen=True, slots=True)
class Ropes:
    """The rotary settings a config names (engine/model/config.py reads both spellings of them): the full-attention
    layers' (the model's own rope), the sliding layers' (Gemma 3's local base; else the same as full), and
    LongRoPE's attention factor (cos and sin both multiplied by it, so the scores by its square; 1.0 otherwise)."""
    full: Rope
    sliding: Rope
    attention_factor: float = 1.0


# describe(config.json's fields, layers, head_dim, the ropes it names) -> Description
Describe = Callable[[dict, int, int, Ropes], Description]


# a layer's Hugging Face module -> llama.cpp's tensor name (blk.{i}.<name>.weight); a family that stores q, k, v or
# gate, up fused (Phi-3: attn_qkv, ffn_up holding gate and up) names its own modules here
LLAMA_TENSORS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
LLAMA_TENSORS.update(EXPERT_TENSORS)         # Mixtral's GGUFs are arch llama


@dataclass(frozen=True, slots=True, eq=False)       # each family is one object: compared as itself
class Family:
    name: str
    model_types: tuple[str, ...]          # config.json's model_type(s); the first is the one a GGUF reads as
    gguf_arch: str                        # a GGUF's general.architecture (also the prefix of its keys)
    gguf_permuted_qk: bool                # llama.cpp's converter interleaved the q / k rows of each head
    describe: Describe
    gguf_tensors: dict[str, str] = field(default_factory=lambda: LLAMA_TENSORS)
    fused_projections: bool = False       # a Hugging Face folder stores self_attn.qkv_proj and mlp.gate_up_proj (Phi-3)


def _llama(cfg: dict, n_layers: int, head_dim: int, ropes: Ropes, experts: Experts | None = None) -> Description:
    # attention_bias: q, k, v and o together (InternLM-style exports); mlp_bias: gate, up and down. Mistral's
    # sliding_window is not read: kvchat has run its models with full attention (v0.3 and later have none). A
    # Llama GGUF with an expert count is Mixtral's (llama.cpp writes Mixtral as arch llama)
    attn = bool(cfg.get("attention_bias", False))
    if experts is None and cfg.get("num_local_experts"):
        experts = _experts_of(cfg, "intermediate_size", normalize=True)
    layer = LayerSpec(rope=ropes.full, query_scale=head_dim ** -0.5, qkv_bias=attn, o_bias=attn,
                      mlp_bias=bool(cfg.get("mlp_bias", False)), experts=experts)
    return Description((layer,) * n_layers)


def _qwen2(cfg: dict, n_layers: int, head_dim: int, ropes: Ropes) -> Description:
    # q, k and v always carry a bias, o never (Qwen2Attention), whatever attention_bias says
    layer = LayerSpec(rope=ropes.full, query_scale=head_dim ** -0.5, qkv_bias=True,
                      mlp_bias=bool(cfg.get("mlp_bias", False)))
    return Description((layer,) * n_layers)


def layer_types(cfg: dict, n_layers: int, every: int) -> tuple[bool, ...]:
    """Which layers slide: config.json's layer_types ("sliding_attention" / "full_attention") where given, else
    the older sliding_window_pattern (every `every`-th layer full, the rest sliding: Gemma 2 alternates from a
    sliding layer 0, Gemma 3 has five sliding then one full)."""
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg.get("sliding_window_pattern") or every)
        return tuple(bool((i + 1) % every) for i in range(n_layers))
    return _typed(types, n_layers, "sliding_attention", "kvchat runs sliding_attention and full_attention layers")


def _typed(types, n_layers: int, kind: str, runs: str) -> tuple[bool, ...]:
    """config.json's layer_types, one entry per layer of `kind` or "full_attention", as whether each is `kind`; a
    list of another length, or another name, is a one-line ModelLoadError (runs: what the family runs, in words)."""
    if not isinstance(types, list) or len(types) != n_layers:
        raise ModelLoadError(f"layer_types has {len(types) if isinstance(types, list) else repr(types)} entries for "
                             f"{n_layers} layers: the model's settings are damaged")
    unknown = sorted({t for t in types if t not in (kind, "full_attention")}, key=str)
    if unknown:
        raise ModelLoadError(f"layer_types names {', '.join(map(repr, unknown))}: {runs}")
    return tuple(t == kind for t in types)


def _window(cfg: dict) -> int:
    """sliding_window, a whole number of tokens (see LayerSpec.window for what it covers)."""
    w = cfg.get("sliding_window")
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise ModelLoadError(f"sliding_window={w!r}: a model with sliding layers needs a positive whole number")
    return w


def _cap(cfg: dict, key: str) -> float | None:
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ModelLoadError(f"{key}={value!r}: a soft-cap must be a finite number above 0, or null")
    return float(value)


def _qwen3(cfg: dict, n_layers: int, head_dim: int, ropes: Ropes) -> Description:
    # Qwen3Attention: q_norm / k_norm over each head before RoPE; q, k, v, o biased together only by attention_bias;
    # sliding layers only where use_sliding_window (layer_types, else the layers from max_window_layers on)
    attn = bool(cfg.get("attention_bias", False))
    if cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None:
        window = _window(cfg)
        first = int(cfg.get("max_window_layers", n_layers))
        sliding = (layer_types(cfg, n_layers, 1) if cfg.get("layer_types") is not None
                   else tuple(i >= first for i in range(n_layers)))
    else:
        window, sliding = None, (False,) * n_layers
    layers = tuple(LayerSpec(rope=ropes.full, query_scale=head_dim ** -0.5, qk_norm=True,
                             window=window if s else None, qkv_bias=attn, o_bias=attn,
                             mlp_bias=bool(cfg.get("mlp_bias", False))) for s in sliding)
    return Description(layers)


def _gemma(cfg: dict, n_layers: int, head_dim: int, ropes: Ropes, *, qk_norm: bool, every: int) -> Description:
    # Gemma 2 / 3: (1 + w) RMSNorms before and after attention and the MLP, GELU (tanh) gate, embeddings times
    # sqrt(hidden), scores at query_pre_attn_scalar ** -0.5, sliding layers over sliding_window with their own rope
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError("use_bidirectional_attention=true: this is an embedding model (bidirectional "
                             "attention), not a chat model kvchat runs")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"hidden_activation={act!r}: kvchat runs Gemma's gelu_pytorch_tanh")
    scalar = cfg.get("query_pre_attn_scalar", head_dim)
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or not 0 < scalar < float("inf"):
        raise ModelLoadError(f"query_pre_attn_scalar={scalar!r}: it must be a finite number above 0")
    sliding = layer_types(cfg, n_layers, every)
    window = _window(cfg) if any(sliding) else None
    softcap = _cap(cfg, "attn_logit_softcapping")
    layers = tuple(LayerSpec(rope=ropes.sliding if s else ropes.full, query_scale=float(scalar) ** -0.5,
                             norm_offset=1.0, post_norms=True, activation="gelu_tanh", qk_norm=qk_norm,
                             window=window if s else None, attn_softcap=softcap,
                             qkv_bias=bool(cfg.get("attention_bias", False)),
                             o_bias=bool(cfg.get("attention_bias", False))) for s in sliding)
    return Description(layers, embed_scale=float(cfg["hidden_size"]) ** 0.5,
                       final_softcap=_cap(cfg, "final_logit_softcapping"))


def _gemma2(cfg: dict, n_layers: int, head_dim: int, ropes: Ropes) -> Description:
    return _gemma(cfg, n_layers, head_dim, ropes, qk_norm=False, every=2)


def _gemma3(cfg: dict, n_layers: int, head_dim: int, ropes: Ropes) -> Description:
    return _gemma(cfg, n_layers, head_dim, ropes, qk_norm=True, every=6)


def _experts_of(cfg: dict, ffn_key: str, *, normalize: bool, **kw) -> Experts:
    """The routed MLP a config names: num_experts (Qwen) or num_local_experts (Mixtral, gpt-oss), top
    num_experts_per_tok, each of intermediate size cfg[ffn_key]; a count that is not a whole number, or more used
    than there are, is a one-line error naming the field."""
    count = cfg.get("num_experts", cfg.get("num_local_experts"))
    used, ffn = cfg.get("num_experts_per_tok"), cfg.get(ffn_key)
    for key, value in (("num_experts", count), ("num_experts_per_tok", used), (ffn_key, ffn)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= (1 << 20):
            raise ModelLoadError(f"{key}={value!r}: a mixture of experts needs a positive whole number")
    if used > count:
        raise ModelLoadError(f"num_experts_per_tok={used} but the model has only {count} experts: the model's "
                             f"settings are damaged")
    return Experts(count, used, ffn, normalize=normalize, **kw)


def _mixtral(cfg: dict, n_layers: int, head_dim: int, ropes: Ropes) -> Description:
    # MixtralSparseMoeBlock: softmax over all experts, the top num_experts_per_tok renormalized, SwiGLU experts of
    # intermediate_size; attention as Llama's (no biases). A Llama GGUF with expert_count reads the same fields
    return _llama(cfg, n_layers, head_dim, ropes, _experts_of(cfg, "intermediate_size", normalize=True))


def _qwen3_moe(cfg: dict, n_layers: int, head_dim: int, ropes: Ropes) -> Description:
    # Qwen3MoeDecoderLayer: Qwen3's attention (q/k norms); a layer's MLP is routed unless it is one of
    # mlp_only_layers or off the decoder_sparse_step grid ((i + 1) % step == 0 is sparse); experts of
    # moe_intermediate_size, the top-k renormalized only where norm_topk_prob
    dense = _qwen3(cfg, n_layers, head_dim, ropes)
    experts = _experts_of(cfg, "moe_intermediate_size", normalize=bool(cfg.get("norm_topk_prob", False)))
    step = cfg.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ModelLoadError(f"decoder_sparse_step={step!r}: it must be a positive whole number")
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ModelLoadError(f"mlp_only_layers={only!r}: expected a list of layer numbers")
    layers = tuple(replace(layer, experts=None if i in only or (i + 1) % step else experts)
                   for i, layer in enumerate(dense.layers))
    return Description(layers)


def _gpt_oss(cfg: dict, n_layers: int, head_dim: int, ropes: Ropes) -> Description:
    # GptOssDecoderLayer: biased q, k, v, o; learned sink logits per head; sliding and full layers by layer_types
    # (sliding on even layers by default); YaRN, its attention factor folded into the query scale; router with a
    # bias, softmax over the top-k logits (the renormalized top-k of the softmax: the same numbers); experts with
    # biases and the clamped SwiGLU (alpha, limit)
    sliding = layer_types(cfg, n_layers, 2)
    window = _window(cfg) if any(sliding) else None
    experts = _experts_of(cfg, "intermediate_size", normalize=True, router_bias=True, expert_bias=True,
                          activation="swiglu_oai", alpha=float(cfg.get("swiglu_alpha", 1.702)),
                          limit=float(cfg.get("swiglu_limit", 7.0)))
    scale = head_dim ** -0.5 * ropes.attention_factor ** 2
    layers = tuple(LayerSpec(rope=ropes.full, query_scale=scale, window=window if s else None, qkv_bias=True,
                             o_bias=True, sink_logits=True, experts=experts) for s in sliding)
    return Description(layers)


def _smollm3(cfg: dict, n_layers: int, head_dim: int, ropes: Ropes) -> Description:
    # SmolLM3: a Llama layer, where no_rope_layers[i] == 0 marks a layer without rotary embeddings (by default
    # every no_rope_layer_interval-th); sliding layers only where use_sliding_window
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = cfg.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % every != 0) for i in range(n_layers)]
    if not isinstance(flags, list) or len(flags) != n_layers or not all(f in (0, 1) for f in flags):
        raise ModelLoadError(f"no_rope_layers={flags!r}: expected {n_layers} entries of 0 or 1")
    window = _window(cfg) if cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None else None
    attn = bool(cfg.get("attention_bias", False))
    nope = Rope(ropes.full.theta, ("nope",), ropes.full.dims)
    layers = tuple(LayerSpec(rope=ropes.full if f else nope, query_scale=head_dim ** -0.5, window=window,
                             qkv_bias=attn, o_bias=attn, mlp_bias=bool(cfg.get("mlp_bias", False))) for f in flags)
    return Description(layers)


def _linear_attention(cfg: dict) -> LinearAttention:
    """The Gated DeltaNet a Qwen3.5 config names (linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
    linear_value_head_dim, linear_conv_kernel_dim), each a positive whole number; value heads a multiple of key heads."""
    keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim")
    values = [cfg.get(k) for k in keys]
    for key, value in zip(keys, values):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 4096:
            raise ModelLoadError(f"{key}={value!r}: a linear-attention layer needs a positive whole number")
    if values[1] % values[0]:
        raise ModelLoadError(f"linear_num_value_heads={values[1]} is not a multiple of linear_num_key_heads="
                             f"{values[0]}: the model's settings are damaged")
    return LinearAttention(*values)


def _layer_kinds(cfg: dict, n_layers: int) -> tuple[bool, ...]:
    """Which layers are linear attention: layer_types ("linear_attention" / "full_attention") where given, else
    every full_attention_interval-th layer full (Qwen3.5: three linear, then one full)."""
    types = cfg.get("layer_types")
    if types is None:
        every = cfg.get("full_attention_interval", 4)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ModelLoadError(f"full_attention_interval={every!r}: it must be a positive whole number")
        return tuple(bool((i + 1) % every) for i in range(n_layers))
    return _typed(types, n_layers, "linear_attention", "a Qwen3.5 model has linear_attention and full_attention layers")


def _qwen3_5(cfg: dict, n_layers: int, head_dim: int, ropes: Ropes) -> Description:
    # Qwen3_5DecoderLayer: zero-centred (1 + w) RMSNorms; gated DeltaNet layers and gated full attention (q_proj gives
    # each head's query and its output gate; q / k norms; a partial rotation, 1/4 of each head by default); the text
    # model's multimodal RoPE is the plain one on text positions. MoE (Qwen3_5MoeSparseMoeBlock): every layer routed,
    # top-k renormalized, plus a shared expert behind a sigmoid gate
    linear = _linear_attention(cfg)
    experts = None
    if cfg.get("num_experts"):
        experts = _experts_of(cfg, "moe_intermediate_size", normalize=True)
        shared = cfg.get("shared_expert_intermediate_size", 0)
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise ModelLoadError(f"shared_expert_intermediate_size={shared!r}: it must be a whole number")
        experts = replace(experts, shared_ffn=shared)
    attn = bool(cfg.get("attention_bias", False))
    full = LayerSpec(rope=ropes.full, query_scale=head_dim ** -0.5, norm_offset=1.0, qk_norm=True, qkv_bias=attn,
                     o_bias=attn, attn_gate=True, experts=experts)
    state = replace(full, linear=linear, qk_norm=False, attn_gate=False, qkv_bias=False, o_bias=False)
    return Description(tuple(state if k else full for k in _layer_kinds(cfg, n_layers)))


def _gemma4(cfg: dict, n_layers: int, head_dim: int, ropes: Ropes) -> Description:
    # Gemma 4 (transformers' Gemma4TextModel): w * RMSNorm (not Gemma 2 / 3's 1 + w) before and after attention and
    # the MLP, q / k norms, v normed without a multiplier, scores at scale 1, sliding layers at their own rope and
    # head size, global ones at a proportional partial rope with their own head size (and KV heads where keys are
    # values), the last num_kv_shared_layers layers reading the KV of the last earlier layer of their kind, per-layer
    # input embeddings, each layer's output times a learned scalar
    if cfg.get("use_bidirectional_attention") == "all":
        raise ModelLoadError("use_bidirectional_attention='all': this is an embedding model (bidirectional "
                             "attention), not a chat model kvchat runs")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"hidden_activation={act!r}: kvchat runs Gemma's gelu_pytorch_tanh")
    experts = None
    if cfg.get("enable_moe_block"):         # routed experts beside every layer's dense MLP (26B-A4B)
        experts = _experts_of({**cfg, "num_experts_per_tok": cfg.get("top_k_experts")}, "moe_intermediate_size",
                              normalize=True, activation="gelu_tanh", beside_dense=True)
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                       for i in range(n_layers)]
    sliding = list(_typed(types, n_layers, "sliding_attention",
                          "kvchat runs sliding_attention and full_attention layers"))
    sliding[-1] = False                      # the last layer attends globally (as transformers forces it)
    kinds = ["sliding_attention" if s else "full_attention" for s in sliding]
    window = _window(cfg) if any(sliding) else None
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    dims = _per_layer_dims(cfg, kinds, k_eq_v)
    sources = _kv_sources(cfg, kinds)
    ffn = int(cfg["intermediate_size"])
    wide = bool(cfg.get("use_double_wide_mlp", False))
    layers = []
    for i, s in enumerate(sliding):
        hd, kvh = dims[i]
        layers.append(LayerSpec(
            rope=ropes.sliding if s else ropes.full, query_scale=1.0, post_norms=True, activation="gelu_tanh",
            qk_norm=True, window=window if s else None, head_dim=None if hd == head_dim else hd,
            kv_heads=None if kvh == int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]) else kvh,
            kv_source=sources.get(i), value_norm=True, value_from_key=k_eq_v and not s,
            ffn=2 * ffn if wide and i in sources else None, output_scale=True, experts=experts,
            qkv_bias=bool(cfg.get("attention_bias", False)), o_bias=bool(cfg.get("attention_bias", False))))
    ple = int(cfg.get("hidden_size_per_layer_input") or 0)
    return Description(tuple(layers), embed_scale=float(cfg["hidden_size"]) ** 0.5,
                       final_softcap=_cap(cfg, "final_logit_softcapping"), per_layer_input=ple,
                       per_layer_vocab=int(cfg.get("vocab_size_per_layer_input") or cfg["vocab_size"]) if ple else 0)


def _per_layer_dims(cfg: dict, kinds: list[str], k_eq_v: bool) -> list[tuple[int, int]]:
    """Gemma 4's (head_dim, KV heads) per layer: config.json's per_layer_config (by layer index or kind) where it
    has one, else global_head_dim (512 by default) for the full-attention layers and num_global_key_value_heads
    where keys are values, as transformers' Gemma4TextConfig reads them."""
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    per = cfg.get("per_layer_config")
    if per is None:
        full = {"head_dim": cfg.get("global_head_dim", 512)}
        if k_eq_v and cfg.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        per = {i: full for i, kind in enumerate(kinds) if kind == "full_attention"}
    if not isinstance(per, dict):
        raise ModelLoadError(f"per_layer_config={per!r}: expected an object of per-layer settings")
    out = []
    for i, kind in enumerate(kinds):
        over = per.get(str(i), per.get(i, per.get(kind))) or {}
        d, h = over.get("head_dim", head_dim), over.get("num_key_value_heads", kv)
        for key, value in (("head_dim", d), ("num_key_value_heads", h)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 1024 \
                    or (key == "head_dim" and value % 2):
                raise ModelLoadError(f"layer {i}'s {key}={value!r}: it must be a positive whole number (even for "
                                     f"head_dim) of at most 1024")
        if cfg["num_attention_heads"] % h:
            raise ModelLoadError(f"layer {i} has {h} KV heads, which do not divide its "
                                 f"{cfg['num_attention_heads']} query heads")
        out.append((d, h))
    return out


def _kv_sources(cfg: dict, kinds: list[str]) -> dict[int, int]:
    """Gemma 4's num_kv_shared_layers: each of the last that many layers attends over the KV of the last earlier
    layer of its kind (transformers' kv_sharing_modes)."""
    n = len(kinds)
    shared = cfg.get("num_kv_shared_layers") or 0
    if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared < n:
        raise ModelLoadError(f"num_kv_shared_layers={shared!r}: it must be a whole number from 0 to "
                             f"{n - 1} (some layer must keep its own KV)")
    first = n - shared
    sources = {}
    for i in range(first, n):
        own = [j for j in range(first) if kinds[j] == kinds[i]]
        if not own:
            raise ModelLoadError(f"layer {i} ({kinds[i]}) shares the KV of an earlier layer of its kind, but none of "
                                 f"the first {first} layers is one: num_kv_shared_layers does not fit layer_types")
        sources[i] = own[-1]
    return sources


def _phi3(cfg: dict, n_layers: int, head_dim: int, ropes: Ropes) -> Description:
    # Phi3Attention: fused qkv_proj / gate_up_proj, no biases; sliding_window, where set, on every layer (one mask
    # for the whole model); LongRoPE's attention factor scales cos and sin, so q . k by its square
    window = _window(cfg) if cfg.get("sliding_window") is not None else None
    layer = LayerSpec(rope=ropes.full, query_scale=head_dim ** -0.5 * ropes.attention_factor ** 2, window=window)
    return Description((layer,) * n_layers)


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",), "llama", True, _llama),
    Family("mistral", ("mistral",), "mistral", False, _llama),
    Family("qwen2", ("qwen2",), "qwen2", False, _qwen2),
    Family("qwen3", ("qwen3",), "qwen3", False, _qwen3, gguf_tensors=QWEN3_TENSORS),
    Family("gemma2", ("gemma2",), "gemma2", False, _gemma2, gguf_tensors=GEMMA2_TENSORS),
    # a Hugging Face "gemma3" folder is the multimodal model (its text model under text_config): only the text
    # model's own folders (gemma3_text) are read; a GGUF of either is general.architecture "gemma3"
    Family("gemma3", ("gemma3_text",), "gemma3", False, _gemma3, gguf_tensors=GEMMA3_TENSORS),
    # Gemma 4's published folders are multimodal (model_type gemma4, the text model under text_config)
    Family("gemma4", ("gemma4_text", "gemma4"), "gemma4", False, _gemma4, gguf_tensors=GEMMA4_TENSORS),
    Family("phi3", ("phi3",), "phi3", False, _phi3, gguf_tensors=PHI3_TENSORS, fused_projections=True),
    # mixtures of experts. Mixtral's GGUF is arch llama (the llama family reads its expert count); a Hugging Face
    # folder names its modules block_sparse_moe.experts.E.w1 / w2 / w3 (the loader reads them as EXPERT_TENSORS)
    Family("mixtral", ("mixtral",), "llama", True, _mixtral),
    Family("qwen3_moe", ("qwen3_moe",), "qwen3moe", False, _qwen3_moe, gguf_tensors=QWEN3MOE_TENSORS),
    Family("gpt_oss", ("gpt_oss",), "gpt-oss", False, _gpt_oss, gguf_tensors=GPT_OSS_TENSORS),
    Family("smollm3", ("smollm3",), "smollm3", True, _smollm3),
    # hybrids of linear attention (a recurrent state) and full attention. A Hugging Face "qwen3_5" folder is the
    # multimodal model; config.py reads its text_config as the text model's own type
    Family("qwen3_5", ("qwen3_5_text", "qwen3_5"), "qwen35", False, _qwen3_5, gguf_tensors=QWEN35_TENSORS),
    Family("qwen3_5_moe", ("qwen3_5_moe_text", "qwen3_5_moe"), "qwen35moe", False, _qwen3_5, gguf_tensors=QWEN35MOE_TENSORS),
)
# mixture-of-experts families: named in the error as such (their routed MLPs are not a layer kvchat computes yet)
MOE_ARCHITECTURES = frozenset({"qwen2_moe", "qwen2moe", "deepseek_v2", "deepseek_v3", "deepseek2", "dbrx", "olmoe", "granitemoe", "phimoe",
                               "jamba", "llama4", "llama4_text", "minimax", "glm4_moe", "glm4moe", "ernie4_5_moe",
                               "hunyuan_v1_moe", "arctic", "grok", "jetmoe", "bailingmoe", "dots1"})
_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
_BY_GGUF_ARCH: dict[str, Family] = {}
for _f in FAMILIES:          # the first family of an arch reads its GGUFs (llama: Llama and Mixtral alike)
    _BY_GGUF_ARCH.setdefault(_f.gguf_arch, _f)


def family_of(model_type: str) -> Family | None:
    """The family of a model_type, or None (a ModelConfig built by hand may name none: it is a Llama layer)."""
    return _BY_MODEL_TYPE.get(model_type)


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
    if name in MOE_ARCHITECTURES:
        return ModelLoadError(f"unsupported architecture {name!r} in {where}: mixture-of-experts families other than "
                              f"mixtral, qwen3_moe and gpt_oss are not supported yet; kvchat runs {supported()}")
    if name == "gemma3":
        return ModelLoadError(f"unsupported architecture 'gemma3' in {where}: this is Gemma 3's multimodal folder; "
                              f"kvchat runs its text model (model_type gemma3_text, or a Gemma 3 GGUF); it runs "
                              f"{supported()}")
    # worded as app/engine_text.py's catalog has it (translated there)
    return ModelLoadError(f"unsupported architecture {name!r} in {where}: kvchat runs the Llama family "
                          f"({supported()})")


def check_architecture(model_type: str, where: str) -> None:
    """A config.json's model_type must be a family's (see family())."""
    family(model_type, where)
