"""A GGUF's architecture keys read back into config.json's words: model knowledge, not the container's.

llama.cpp's converter writes a family's settings as `{arch}.*` metadata keys (named by gguf.constants.Keys)
and derives some of them at load instead of storing them (Gemma's query scale, its window pattern, Gemma 3's
local RoPE base, Qwen3.5's layer pattern): `family_config` returns those fields under the names a Hugging Face
config.json of the same model gives them (transformers' Qwen3Config, Gemma2Config, Gemma3TextConfig, Phi3Config,
Qwen3_5TextConfig), so that one family `describe` reads both sources. The tensor tables name each layer module's
llama.cpp tensor (gguf.constants.TENSOR_NAMES of the arch's MODEL_TENSORS), and where the converter stored a tensor
in another order than transformers (Qwen3.5's tiled value heads) the order back is here too. engine/gguf/ reads any
file; what its keys and tensors mean for a model is decided here and in gguf_view.py.
"""
from __future__ import annotations

import math

import numpy as np

from kvchat.engine.errors import ModelLoadError

# Hugging Face layer module -> llama.cpp tensor (blk.{i}.<name>.weight), per architecture
QWEN3_TENSORS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
# a mixture-of-experts layer's modules, in kvchat's own names for them (every loader reads its source's names into
# these): the router [experts, hidden] (+ bias) and each expert matrix as one 3-D tensor [experts, out, in], as
# llama.cpp stores them (a Hugging Face checkpoint's per-expert or fused tensors are read into them; their biases
# [experts, out]). Mixtral's older GGUFs store one 2-D tensor per expert (blk.N.ffn_gate.E.weight): GGUFFile reads
# those as the same 3-D names (GGUFModel.hf_shapes, expert_names).
EXPERT_TENSORS = {"mlp.router": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps",
                  "mlp.experts.up_proj": "ffn_up_exps", "mlp.experts.down_proj": "ffn_down_exps"}
# llama.cpp's per-expert tensor of Mixtral's older GGUFs: ffn_gate.E -> the 3-D module above
PER_EXPERT_TENSORS = {"ffn_gate": "mlp.experts.gate_proj", "ffn_up": "mlp.experts.up_proj",
                      "ffn_down": "mlp.experts.down_proj"}
QWEN3MOE_TENSORS = {**QWEN3_TENSORS, **EXPERT_TENSORS}
# gpt-oss: biased attention, learned sink logits (attn_sinks), and the pre-MLP norm llama.cpp calls post_attention_norm
GPT_OSS_TENSORS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.sinks": "attn_sinks", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm", **EXPERT_TENSORS,
}
# Gemma 2 / 3: post_attention_layernorm is the norm *after* attention; the MLP's pre-norm is ffn_norm
GEMMA2_TENSORS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
}
GEMMA3_TENSORS = {**GEMMA2_TENSORS, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
# Phi-3 stores q, k, v as one matrix and gate, up as one (ffn_up holds 2 x intermediate rows: gate first)
PHI3_TENSORS = {
    "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}

# Qwen3.5 / 3.6 (llama.cpp's qwen35 / qwen35moe): gated attention layers (attn_q holds each head's query and its
# output gate, as the Hugging Face q_proj does) beside Gated DeltaNet layers. kvchat's own names for a linear-attention
# layer's tensors (every loader reads its source into them): in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, the
# depthwise conv1d [channels, kernel], dt.bias (the time-step bias), A.weight (the decay rate A = -exp(A_log), which
# llama.cpp's converter stores as such), norm.weight (the gated RMSNorm's multiplier, not zero-centred) and out_proj.
# The MLP's pre-norm is post_attention_norm in llama.cpp's qwen35 (as in gpt-oss), not ffn_norm
QWEN35_TENSORS = {
    **QWEN3_TENSORS, "post_attention_layernorm": "post_attention_norm",
    "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta", "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.conv1d": "ssm_conv1d", "linear_attn.dt": "ssm_dt", "linear_attn.A": "ssm_a",
    "linear_attn.norm": "ssm_norm", "linear_attn.out_proj": "ssm_out",
}
# the shared expert of Qwen3.5-MoE (and its sigmoid gate [1, hidden])
SHARED_EXPERT_TENSORS = {"mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
                         "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
QWEN35MOE_TENSORS = {**QWEN35_TENSORS, **EXPERT_TENSORS, **SHARED_EXPERT_TENSORS}
# llama.cpp tensors named without a .weight suffix (its converter maps A_log, a bare parameter, to blk.N.ssm_a)
BARE_TENSORS = frozenset({"ssm_a"})
# the linear-attention tensors whose value heads llama.cpp's converter reorders (value_head_order), and the rows (or
# columns: out_proj) of one head in each: in_proj_qkv's and conv1d's after the 2 x key_dim query / key channels
_VALUE_HEAD_TENSORS = {"linear_attn.in_proj_qkv.weight": "value", "linear_attn.conv1d.weight": "value",
                       "linear_attn.in_proj_z.weight": "value", "linear_attn.out_proj.weight": "value",
                       "linear_attn.in_proj_b.weight": "head", "linear_attn.in_proj_a.weight": "head",
                       "linear_attn.dt.bias": "head", "linear_attn.A.weight": "head"}

# llama.cpp's defaults where a Gemma 2 file lacks the key (llama_hparams; Gemma 2's published settings)
GEMMA2_WINDOW = 4096
GEMMA2_ATTN_SOFTCAP = 50.0
GEMMA2_FINAL_SOFTCAP = 30.0
# llama.cpp gives Gemma 3's sliding layers this RoPE base (rope_freq_base_train_swa), unscaled
GEMMA3_LOCAL_THETA = 10000.0
# the layer counts llama.cpp reads as the 27B models, whose query scale is (hidden / heads) ** -0.5
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# how often a global layer comes: llama.cpp's set_swa_pattern(n): layer i slides unless i % n == n - 1
SWA_PATTERN = {"gemma2": 2, "gemma3": 6}


def query_pre_attn_scalar(arch: str, layers: int, hidden: int, heads: int, head_dim: int) -> int:
    """Gemma's query_pre_attn_scalar as llama.cpp derives it (f_attention_scale): hidden / heads on the 27B
    models, head_dim on the others. A GGUF does not store it."""
    return hidden // heads if layers == _GEMMA_27B_LAYERS.get(arch) else head_dim


def layer_types(arch: str, layers: int, windowed: bool) -> list[str]:
    """config.json's layer_types under llama.cpp's window pattern of `arch`."""
    n = SWA_PATTERN[arch]
    return ["sliding_attention" if windowed and i % n != n - 1 else "full_attention" for i in range(layers)]


def family_config(gf, base: dict) -> dict:
    """The fields beyond `base` (hf_config's Llama fields) that the GGUF `gf` of a non-Llama family (or a Llama file
    with experts: Mixtral) gives, in config.json's names; {} for a dense Llama."""
    arch = gf.arch
    reader = _ARCH_FIELDS.get(arch)
    return reader(gf, arch, base) if reader else {}


def key_names(arch: str) -> dict[str, str]:
    """family_config's fields -> the header's keys, for messages."""
    return {"sliding_window": f"{arch}.attention.sliding_window",
            "attn_logit_softcapping": f"{arch}.attn_logit_softcapping",
            "final_logit_softcapping": f"{arch}.final_logit_softcapping",
            "original_max_position_embeddings": f"{arch}.rope.scaling.original_context_length",
            "rope_parameters.attention_factor": f"{arch}.rope.scaling.attn_factor",
            "num_experts": f"{arch}.expert_count", "num_experts_per_tok": f"{arch}.expert_used_count",
            "moe_intermediate_size": f"{arch}.expert_feed_forward_length",
            "shared_expert_intermediate_size": f"{arch}.expert_shared_feed_forward_length",
            "layer_types": f"{arch}.full_attention_interval", "partial_rotary_factor": f"{arch}.rope.dimension_count",
            "linear_conv_kernel_dim": f"{arch}.ssm.conv_kernel", "linear_key_head_dim": f"{arch}.ssm.state_size",
            "linear_num_key_heads": f"{arch}.ssm.group_count", "linear_num_value_heads": f"{arch}.ssm.time_step_rank",
            "linear_value_head_dim": f"{arch}.ssm.inner_size / {arch}.ssm.time_step_rank"}


def gguf_tensor_name(layer: int | str, short: str, kind: str) -> str:
    """llama.cpp's name of layer `layer`'s tensor `short` (attn_q, ssm_a) of kind weight or bias:
    blk.N.<short>.<kind>, or blk.N.<short> for the bare ones (BARE_TENSORS)."""
    return f"blk.{layer}.{short}" if short in BARE_TENSORS and kind == "weight" else f"blk.{layer}.{short}.{kind}"


def trunk_layers(gf) -> int:
    """The layers a model runs: block_count less the multi-token-prediction blocks llama.cpp's converter appends
    after them (nextn_predict_layers; Qwen3.5's one MTP block), which kvchat does not run."""
    blocks = gf.field(f"{gf.arch}.block_count")
    extra = gf.fields.get(f"{gf.arch}.nextn_predict_layers", 0)
    if not isinstance(extra, int) or not 0 <= extra < blocks:
        raise ModelLoadError(f"{gf.path.name}: {gf.arch}.nextn_predict_layers={extra!r} of {blocks} blocks: the file "
                             f"is damaged; re-download or re-convert it")
    return blocks - extra


def value_head_order(gf, hf_name: str) -> tuple[int, np.ndarray] | None:
    """(axis, index): the stored tensor `hf_name` (kvchat's name) of the GGUF gf, taken at `index` along `axis`, is
    in transformers' order (tiled_value_heads, with the file's ssm.* keys); None where the file keeps that order."""
    a = gf.arch
    if a not in ("qwen35", "qwen35moe") or ".linear_attn." not in hf_name:
        return None
    hv = gf.field(f"{a}.ssm.time_step_rank")
    return tiled_value_heads(hf_name, gf.field(f"{a}.ssm.group_count"), hv, gf.field(f"{a}.ssm.state_size"),
                             gf.field(f"{a}.ssm.inner_size") // hv)


def tiled_value_heads(hf_name: str, key_heads: int, value_heads: int, key_dim: int,
                      value_dim: int) -> tuple[int, np.ndarray] | None:
    """(axis, index) taking llama.cpp's stored order of a Gated DeltaNet tensor back to transformers' (np.take;
    np.argsort(index) goes the other way); None for a tensor, or a model, whose order the converter keeps.

    Where there are more value heads than key heads (Qwen3.5: 32 over 16), llama.cpp's converter stores the value
    heads tiled (the first value head of every key head, then the second of every one, ...) instead of grouped by
    key head as transformers holds them, so that ggml's broadcast repeats the keys: the rows of in_proj_z, in_proj_b,
    in_proj_a, dt.bias and A.weight, the value rows of in_proj_qkv and conv1d (after the query and key channels) and
    the columns of out_proj. A packed matrix's rows can be taken so; out_proj's columns only by whole blocks."""
    unit = _VALUE_HEAD_TENSORS.get("linear_attn." + hf_name.split(".linear_attn.", 1)[-1])
    if unit is None or key_heads == value_heads:
        return None
    group = value_heads // key_heads
    width = 1 if unit == "head" else value_dim
    h = np.arange(value_heads)
    stored = (h % group) * key_heads + h // group      # transformers' head g * group + i is stored at i * key_heads + g
    index = (stored[:, None] * width + np.arange(width)).reshape(-1)
    if hf_name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
        keys = 2 * key_heads * key_dim
        index = np.concatenate([np.arange(keys), keys + index])
    return (1 if hf_name.endswith(".out_proj.weight") else 0), index


def _head_dim(base: dict) -> int:
    return int(base["head_dim"] or base["hidden_size"] // base["num_attention_heads"])


def _gemma(gf, arch: str, base: dict) -> dict:
    head_dim = _head_dim(base)
    layers = int(base["num_hidden_layers"])
    cfg = {"hidden_activation": "gelu_pytorch_tanh",
           "query_pre_attn_scalar": query_pre_attn_scalar(arch, layers, int(base["hidden_size"]),
                                                          int(base["num_attention_heads"]), head_dim)}
    window = gf.fields.get(f"{arch}.attention.sliding_window")
    if arch == "gemma2":
        window = GEMMA2_WINDOW if window is None else window
        cfg["attn_logit_softcapping"] = float(gf.fields.get(f"{arch}.attn_logit_softcapping", GEMMA2_ATTN_SOFTCAP))
        cfg["final_logit_softcapping"] = float(gf.fields.get(f"{arch}.final_logit_softcapping", GEMMA2_FINAL_SOFTCAP))
    else:
        # Gemma 3 has no attention soft-cap; a final one only where the file sets it (0: none, as llama.cpp reads it)
        final = gf.fields.get(f"{arch}.final_logit_softcapping")
        cfg["attn_logit_softcapping"] = None
        cfg["final_logit_softcapping"] = float(final) if final else None
    windowed = bool(window) and window > 0
    cfg["sliding_window"] = int(window) if windowed else None
    cfg["layer_types"] = layer_types(arch, layers, windowed)
    if arch == "gemma3":
        # the file's rope keys are the global layers'; the sliding ones turn at the local base, unscaled
        full = {"rope_type": "default", "rope_theta": float(base["rope_theta"])}
        scaling = base.get("rope_scaling")
        if scaling:
            full.update(rope_type=scaling["rope_type"], factor=scaling["factor"])
        local = float(gf.fields.get(f"{arch}.rope.freq_base_swa", GEMMA3_LOCAL_THETA))
        cfg["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": local},
                                  "full_attention": full}
        cfg["rope_scaling"] = None          # it is the global layers' own, in rope_parameters
    return cfg


def _phi3(gf, arch: str, base: dict) -> dict:
    head_dim = _head_dim(base)
    dims = int(gf.fields.get(f"{arch}.rope.dimension_count", head_dim))
    if not 0 < dims <= head_dim or dims % 2:
        raise ModelLoadError(f"{gf.path.name}: {arch}.rope.dimension_count is {dims}, not an even number of at most "
                             f"the head's {head_dim} dimensions: the file is damaged; re-download or re-convert it")
    rope = {"rope_type": "default", "rope_theta": float(base["rope_theta"]), "partial_rotary_factor": dims / head_dim}
    cfg = {"hidden_act": "silu", "sliding_window": gf.fields.get(f"{arch}.attention.sliding_window")}
    long, short = gf.tensors.get("rope_factors_long.weight"), gf.tensors.get("rope_factors_short.weight")
    if (long is None) != (short is None):
        raise ModelLoadError(f"{gf.path.name} has only one of rope_factors_long / rope_factors_short: the file is "
                             f"incomplete; re-download or re-convert it")
    if long is not None:
        factors = {k: [float(v) for v in np.asarray(t.data, dtype=np.float32)]
                   for k, t in (("long_factor", long), ("short_factor", short))}
        for key, values in factors.items():
            if len(values) != dims // 2 or not all(math.isfinite(v) and v > 0 for v in values):
                raise ModelLoadError(f"{gf.path.name}: rope_factors_{key.split('_')[0]} holds {len(values)} values, "
                                     f"not {dims // 2} positive ones: the file is damaged; re-download or re-convert it")
        original = gf.fields.get(f"{arch}.rope.scaling.original_context_length")
        if original is None:
            raise ModelLoadError(f"{gf.path.name} has LongRoPE factors but lacks the metadata key "
                                 f"'{arch}.rope.scaling.original_context_length': the file is incomplete")
        rope.update(rope_type="longrope", original_max_position_embeddings=int(original), **factors)
        factor = gf.fields.get(f"{arch}.rope.scaling.attn_factor")
        if factor is not None:
            rope["attention_factor"] = float(factor)
        cfg["original_max_position_embeddings"] = int(original)
    cfg["rope_parameters"] = rope
    cfg["rope_scaling"] = None
    return cfg


def _experts(gf, arch: str, base: dict, ffn_key: str) -> dict:
    """A mixture of experts' counts in config.json's names (num_local_experts, num_experts_per_tok and the experts'
    intermediate size under ffn_key); {} where the file names no experts."""
    count = gf.fields.get(f"{arch}.expert_count")
    if not count:
        return {}
    used = gf.fields.get(f"{arch}.expert_used_count")
    if isinstance(used, int) and isinstance(count, int) and used > count:
        raise ModelLoadError(f"{gf.path.name} has {arch}.expert_used_count={used} but {arch}.expert_count={count}: a "
                             f"token cannot use more experts than there are; the file is damaged")
    ffn = gf.fields.get(f"{arch}.expert_feed_forward_length", base.get("intermediate_size"))
    return {"num_local_experts": count, "num_experts_per_tok": used, ffn_key: ffn}


def _llama(gf, arch: str, base: dict) -> dict:
    # Mixtral is written as arch llama with an expert count; its experts' intermediate size is feed_forward_length
    return _experts(gf, arch, base, "intermediate_size")


def _qwen3moe(gf, arch: str, base: dict) -> dict:
    # llama.cpp renormalizes the top-k weights of qwen3moe unless the file says otherwise (expert_weights_norm)
    cfg = _experts(gf, arch, base, "moe_intermediate_size")
    cfg["norm_topk_prob"] = bool(gf.fields.get(f"{arch}.expert_weights_norm", True))
    cfg["decoder_sparse_step"], cfg["mlp_only_layers"] = 1, []
    if base.get("intermediate_size") is None:
        cfg["intermediate_size"] = cfg.get("moe_intermediate_size")
    return cfg


def _gpt_oss(gf, arch: str, base: dict) -> dict:
    # sliding window on the even layers (llama.cpp's swa pattern 2), YaRN as its config.json gives it (truncate off:
    # transformers' gpt-oss reads it so), the clamped SwiGLU's published constants
    cfg = _experts(gf, arch, base, "intermediate_size")
    layers = int(base["num_hidden_layers"])
    window = gf.fields.get(f"{arch}.attention.sliding_window")
    cfg["sliding_window"] = int(window) if window else None
    cfg["layer_types"] = ["sliding_attention" if window and i % 2 == 0 else "full_attention" for i in range(layers)]
    kind = gf.fields.get(f"{arch}.rope.scaling.type")
    if kind == "yarn":
        cfg["rope_parameters"] = {
            "rope_type": "yarn", "rope_theta": float(base["rope_theta"]),
            "factor": float(gf.field(f"{arch}.rope.scaling.factor")),
            "original_max_position_embeddings": int(gf.field(f"{arch}.rope.scaling.original_context_length")),
            "beta_fast": float(gf.fields.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(gf.fields.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}
        cfg["rope_scaling"] = None
    cfg["swiglu_alpha"], cfg["swiglu_limit"] = 1.702, float(gf.fields.get(f"{arch}.swiglu_limit", 7.0) or 7.0)
    return cfg


def _qwen35(gf, arch: str, base: dict) -> dict:
    # llama.cpp's qwen35 / qwen35moe: every full_attention_interval-th layer full attention (4 where the key is
    # absent), the others Gated DeltaNet whose shape the ssm.* keys give (state_size: the key head width, group_count:
    # the key heads, time_step_rank: the value heads, inner_size: their total width); rope.dimension_count of head_dim
    # rotated; routing renormalized over the top k (llama.cpp stores no key for it). block_count counts the MTP block
    cfg = {"num_hidden_layers": trunk_layers(gf)}
    layers, head_dim = cfg["num_hidden_layers"], _head_dim(base)
    every = gf.fields.get(f"{arch}.full_attention_interval", 4)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ModelLoadError(f"{gf.path.name}: {arch}.full_attention_interval={every!r} is not a positive whole "
                             f"number: the file is damaged; re-download or re-convert it")
    cfg["layer_types"] = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    dims = int(gf.field(f"{arch}.rope.dimension_count"))
    if not 0 < dims <= head_dim or dims % 2:
        raise ModelLoadError(f"{gf.path.name}: {arch}.rope.dimension_count is {dims}, not an even number of at most "
                             f"the head's {head_dim} dimensions: the file is damaged; re-download or re-convert it")
    cfg["partial_rotary_factor"] = dims / head_dim
    value_heads, inner = int(gf.field(f"{arch}.ssm.time_step_rank")), int(gf.field(f"{arch}.ssm.inner_size"))
    if value_heads < 1 or inner % value_heads:
        raise ModelLoadError(f"{gf.path.name}: {arch}.ssm.inner_size={inner} is not a whole number of "
                             f"{arch}.ssm.time_step_rank={value_heads} value heads: the file is damaged")
    cfg.update(linear_conv_kernel_dim=int(gf.field(f"{arch}.ssm.conv_kernel")),
               linear_key_head_dim=int(gf.field(f"{arch}.ssm.state_size")),
               linear_num_key_heads=int(gf.field(f"{arch}.ssm.group_count")),
               linear_num_value_heads=value_heads, linear_value_head_dim=inner // value_heads)
    experts = _experts(gf, arch, base, "moe_intermediate_size")
    if experts:
        cfg.update(num_experts=experts["num_local_experts"], num_experts_per_tok=experts["num_experts_per_tok"],
                   moe_intermediate_size=experts["moe_intermediate_size"],
                   shared_expert_intermediate_size=int(gf.fields.get(f"{arch}.expert_shared_feed_forward_length", 0)))
    return cfg


def _smollm3(gf, arch: str, base: dict) -> dict:
    # llama.cpp leaves RoPE out of every fourth layer of smollm3 (n_no_rope_layer_step); a file may name another step
    step = int(gf.fields.get(f"{arch}.no_rope_layer_interval", 4))
    return {"no_rope_layer_interval": step}


_ARCH_FIELDS = {"gemma2": _gemma, "gemma3": _gemma, "phi3": _phi3, "llama": _llama, "qwen3moe": _qwen3moe,
                "gpt-oss": _gpt_oss, "smollm3": _smollm3, "qwen35": _qwen35, "qwen35moe": _qwen35}
