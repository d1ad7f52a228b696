"""A GGUF's architecture keys read back into config.json's words: model knowledge, not the container's.

llama.cpp's converter writes a family's settings as `{arch}.*` metadata keys (named by gguf.constants.Keys)
and derives some of them at load instead of storing them (Gemma's query scale, its window pattern, Gemma 3's
local RoPE base, Qwen3.5's layer pattern): `family_config` returns those fields under the names a Hugging Face
config.json of the same model gives them (transformers' Qwen3Config, Gemma2Config, Gemma3TextConfig, Phi3Config,
Qwen3_5TextConfig), so that one family `describe` reads both sources. The tensor tables name each layer module's
llama.cpp tensor (gguf.constants.TENSOR_NAMES of the arch's MODEL_TENSORS), and where the converter stored a tensor
in another order than transformers (Qwen3.5's tiled value heads) the order back is here too. engine/gguf/ reads any
file; what its keys and tensors mean for a model is decided here and in gguf_view.py.

Past 450 lines on purpose: every architecture's header and tensor names side by side, read into the same
config.json words; a family's GGUF reading apart from the others' would hide where llama.cpp stores one differently.
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
# Gemma 4 (llama.cpp's gemma4; transformers' Gemma4TextDecoderLayer). Its converter stores every tensor as it is:
# Gemma4RMSNorm multiplies by w (not Gemma 2/3's 1 + w), so no norm is shifted; the PLE tables are the checkpoint's
# own, their scales (sqrt(per-layer width), hidden ** -0.5, 2 ** -0.5) applied at run time by llama.cpp as by
# transformers. The pre-MLP norm is ffn_norm, the post-attention one post_attention_norm. A KV-shared layer (the last
# num_kv_shared_layers) and, under attention_k_eq_v, a full layer's v_proj have no tensors: llama.cpp reads the
# missing attn_v as "values are the raw keys", a shared layer's missing attn_k / attn_k_norm as "reuse the cache of
# layer first_shared - 1 (full) or - 2 (sliding)". The MoE block sits beside the dense MLP (which llama.cpp runs as
# a shared expert), under kvchat's names mlp.router / mlp.experts (weights.expert_state): the router projection
# ffn_gate_inp with its input multiplier router.scale as ffn_gate_inp.scale, the experts' gate | up fused as
# llama.cpp stores them (ffn_gate_up_exps [experts, 2 x ffn, hidden]: kvchat's mlp.experts.gate_proj is its first
# half of rows, up_proj the second), down as ffn_down_exps, and two tensors under names of their own
# (GEMMA4_RENAMED). Keys: kvchat's layer modules; each keeps its kind (weight, scale): blk.N.<short>.<kind>.
GEMMA4_TENSORS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "per_layer_input_gate": "inp_gate", "per_layer_projection": "proj", "post_per_layer_input_norm": "post_norm",
    "mlp.router": "ffn_gate_inp", "mlp.experts.gate_up_proj": "ffn_gate_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps", "pre_feedforward_layernorm_2": "pre_ffw_norm_2",
    "post_feedforward_layernorm_1": "post_ffw_norm_1", "post_feedforward_layernorm_2": "post_ffw_norm_2",
}
# a layer's Gemma 4 tensors whose llama.cpp name is not <module>.<kind>: the bare layer_scalar [1] and the per-expert
# output scale [experts] (transformers' router.per_expert_scale, which llama.cpp multiplies each expert's down by)
GEMMA4_RENAMED = {"layer_scalar": "layer_output_scale.weight", "mlp.router.per_expert_scale": "ffn_down_exps.scale"}
# a Gemma 4 checkpoint's layer tensors -> kvchat's names (as weights.expert_state reads them, the fused experts not
# yet split); the rest keep theirs
GEMMA4_HF_NAMES = {"router.proj.weight": "mlp.router.weight", "router.scale": "mlp.router.scale",
                   "router.per_expert_scale": "mlp.router.per_expert_scale",
                   "experts.gate_up_proj": "mlp.experts.gate_up_proj.weight",
                   "experts.down_proj": "mlp.experts.down_proj.weight"}
# Gemma 4's model-level tensors beyond token_embd / output_norm / output: the per-layer embedding (PLE) table
# [vocab_size_per_layer_input, layers x per-layer width] (quantized as token_embd is), its projection of the scaled
# token embedding [layers x width, hidden] and that projection's norm [width]; rope_freqs [global_head_dim / 2] is
# the converter's own (GEMMA4_ROPE_FREQS)
GEMMA4_MODEL_TENSORS = {"model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
                        "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
                        "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight"}
# the full layers' proportional RoPE: llama.cpp rotates all global_head_dim dimensions (rope.dimension_count) as NeoX
# pairs (i, i + d/2) at freq_base ** (-2i / d) divided by rope_freqs[i]: 1 for the partial_rotary_factor x d / 2
# rotated pairs, GEMMA4_UNROTATED (an angle of ~0) for the others, which is transformers' proportional inv_freq
GEMMA4_ROPE_FREQS = "rope_freqs.weight"
GEMMA4_UNROTATED = 1e30

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
            "linear_value_head_dim": f"{arch}.ssm.inner_size / {arch}.ssm.time_step_rank",
            **(_gemma4_key_names(arch) if arch == "gemma4" else {})}


def _gemma4_key_names(arch: str) -> dict[str, str]:
    return {"head_dim": f"{arch}.attention.key_length_swa", "global_head_dim": f"{arch}.attention.key_length",
            "num_key_value_heads": f"{arch}.attention.head_count_kv",
            "num_global_key_value_heads": f"{arch}.attention.head_count_kv",
            "layer_types": f"{arch}.attention.sliding_window_pattern",
            "num_kv_shared_layers": f"{arch}.attention.shared_kv_layers",
            "hidden_size_per_layer_input": f"{arch}.embedding_length_per_layer_input",
            "vocab_size_per_layer_input": "per_layer_token_embd.weight's rows",
            "intermediate_size": f"{arch}.feed_forward_length", "use_double_wide_mlp": f"{arch}.feed_forward_length",
            "rope_parameters.sliding_attention.rope_theta": f"{arch}.rope.freq_base_swa",
            "rope_parameters.full_attention.rope_theta": f"{arch}.rope.freq_base",
            "rope_parameters.full_attention.partial_rotary_factor": GEMMA4_ROPE_FREQS,
            "attention_k_eq_v": "blk.N.attn_v.weight (absent from the full layers: keys are values)",
            "top_k_experts": f"{arch}.expert_used_count"}


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


def _gemma4(gf, arch: str, base: dict) -> dict:
    """llama.cpp's gemma4 header in Gemma4TextConfig's words. The file stores per layer what the config derives:
    sliding_window_pattern (one bool a layer) is layer_types, key_length / key_length_swa the full / sliding head
    widths, head_count_kv (an array where the two kinds differ) both head counts, feed_forward_length (an array under
    use_double_wide_mlp: the shared layers' twice the others'); values equal to keys (attention_k_eq_v) show as the
    full layers' missing attn_v, the full layers' proportional RoPE as rope_freqs. What one Gemma4TextConfig cannot
    say (KV heads or MLP widths that vary otherwise, attn_v in some full layers only, other RoPE) is refused as a
    damaged file."""
    def damaged(what: str) -> ModelLoadError:
        return ModelLoadError(f"{gf.path.name}: {what}: the file is damaged; re-download or re-convert it")

    layers, key = int(base["num_hidden_layers"]), f"{arch}.attention.sliding_window_pattern"
    pattern = gf.field(key)
    pattern = [pattern] * layers if isinstance(pattern, bool) else pattern      # a bool array reads as 0 / 1
    if not isinstance(pattern, list) or len(pattern) != layers or not all(p in (0, 1) for p in pattern):
        raise damaged(f"{key} is not one true / false per layer of {layers}")
    if pattern[-1]:
        raise damaged(f"{key} makes the last layer sliding (Gemma 4's last layer attends to every position)")
    types = ["sliding_attention" if p else "full_attention" for p in pattern]
    shared = int(gf.fields.get(f"{arch}.attention.shared_kv_layers", 0))
    first_shared = layers - shared
    if not 0 <= shared < layers or not set(types[first_shared:]) <= set(types[:first_shared]):
        raise damaged(f"{arch}.attention.shared_kv_layers={shared} of {layers} layers leaves a shared layer no "
                      f"earlier layer of its kind to take its keys and values from")
    cfg = {"layer_types": types, "num_kv_shared_layers": shared, "hidden_activation": "gelu_pytorch_tanh",
           "attention_bias": False, "sliding_window": int(gf.field(f"{arch}.attention.sliding_window"))}
    head_dim, global_head_dim = (int(gf.field(f"{arch}.attention.key_length{s}")) for s in ("_swa", ""))
    for s, width in (("_swa", head_dim), ("", global_head_dim)):
        if int(gf.fields.get(f"{arch}.attention.value_length{s}", width)) != width:
            raise damaged(f"{arch}.attention.value_length{s} differs from key_length{s} (llama.cpp needs them equal)")
    cfg.update(head_dim=head_dim, global_head_dim=global_head_dim)
    cfg.update(_gemma4_heads(gf, arch, types, first_shared, damaged))
    cfg.update(_gemma4_rope(gf, arch, base, head_dim, global_head_dim, "full_attention" in types, damaged))
    # llama.cpp caps the logits at its Gemma 2 default where the key is absent; 0 turns the cap off
    final = gf.fields.get(f"{arch}.final_logit_softcapping", GEMMA2_FINAL_SOFTCAP)
    cfg["final_logit_softcapping"] = float(final) if final else None
    width = int(gf.field(f"{arch}.embedding_length_per_layer_input"))
    cfg["hidden_size_per_layer_input"], cfg["vocab_size_per_layer_input"] = width, int(base["vocab_size"])
    table = gf.tensors.get(GEMMA4_MODEL_TENSORS["model.embed_tokens_per_layer.weight"])
    if width and (table is None or tuple(table.shape) != (layers * width, int(base["vocab_size"]))):
        raise damaged(f"per_layer_token_embd.weight is {None if table is None else list(table.shape)}, not "
                      f"[{layers} layers x {width}, {base['vocab_size']} tokens] (llama.cpp reads one row a token)")
    ffn = gf.fields.get(f"{arch}.feed_forward_length", base.get("intermediate_size"))
    ffn = ffn if isinstance(ffn, list) else [ffn] * layers
    double = [ffn[0] if i < first_shared else 2 * ffn[0] for i in range(layers)]
    if ffn != [ffn[0]] * layers and (ffn != double or not shared):
        raise damaged(f"{arch}.feed_forward_length={ffn} is neither one width nor twice it in the "
                      f"{shared} KV-shared layers (use_double_wide_mlp)")
    cfg["intermediate_size"], cfg["use_double_wide_mlp"] = ffn[0], ffn != [ffn[0]] * layers
    cfg.update(_gemma4_experts(gf, arch, base, layers, damaged))
    return cfg


def _gemma4_heads(gf, arch: str, types: list[str], first_shared: int, damaged) -> dict:
    # one KV head count per kind of layer; keys as values (no attn_v) in all the full layers with a KV of their own
    key = f"{arch}.attention.head_count_kv"
    heads = gf.field(key)
    heads = heads if isinstance(heads, list) else [heads] * len(types)
    counts = {kind: {h for h, t in zip(heads, types) if t == kind} for kind in set(types)}
    if len(heads) != len(types) or any(len(c) != 1 for c in counts.values()):
        raise damaged(f"{key}={heads} is not one count for every sliding layer and one for every full one")
    full = counts["full_attention"].pop()
    sliding = counts["sliding_attention"].pop() if "sliding_attention" in counts else full
    lacks_v = {types[i]: set() for i in range(first_shared)}
    for i in range(first_shared):
        lacks_v[types[i]].add(f"blk.{i}.attn_v.weight" not in gf.tensors)
    if True in lacks_v.get("sliding_attention", ()) or len(lacks_v["full_attention"]) != 1:
        raise damaged("attn_v.weight is missing from some layers: only all the full layers may lack it "
                      "(attention_k_eq_v)")
    k_eq_v = lacks_v["full_attention"] == {True}
    if full != sliding and not k_eq_v:
        raise damaged(f"{key} gives the full layers {full} KV heads and the sliding ones {sliding}, but the full "
                      f"layers have values of their own (Gemma 4 has global KV heads only with keys as values)")
    return {"num_key_value_heads": sliding, "num_global_key_value_heads": full if k_eq_v else None,
            "attention_k_eq_v": k_eq_v}


def _gemma4_rope(gf, arch: str, base: dict, head_dim: int, global_head_dim: int, has_full: bool, damaged) -> dict:
    # sliding layers: plain RoPE over all head_dim; full ones: proportional, all global_head_dim dimensions at
    # freq_base ** (-2i / d), the unrotated pairs' factor GEMMA4_UNROTATED (rope_freqs)
    if base.get("rope_scaling"):
        raise damaged(f"{arch}.rope.scaling.type scales Gemma 4's RoPE, which its converter never writes")
    dims = int(gf.fields.get(f"{arch}.rope.dimension_count", global_head_dim))
    dims_swa = int(gf.fields.get(f"{arch}.rope.dimension_count_swa", dims))
    if dims != global_head_dim or dims_swa != head_dim:
        raise damaged(f"{arch}.rope.dimension_count={dims} / dimension_count_swa={dims_swa} are not the full and "
                      f"sliding head widths {global_head_dim} / {head_dim}")
    theta = float(base["rope_theta"])
    rotated = global_head_dim // 2
    if has_full:
        t = gf.tensors.get(GEMMA4_ROPE_FREQS)
        if t is None:
            raise ModelLoadError(f"{gf.path.name} lacks {GEMMA4_ROPE_FREQS}, the full layers' proportional RoPE: the "
                                 f"file is incomplete; re-download or re-convert it")
        factors = np.asarray(t.data, dtype=np.float32).reshape(-1)
        rotated = int(np.count_nonzero(factors == 1.0))
        if len(factors) != global_head_dim // 2 or not np.all(factors[rotated:] >= 1e20) or rotated == 0:
            raise damaged(f"{GEMMA4_ROPE_FREQS} is not {global_head_dim // 2} factors, ones then "
                          f"{GEMMA4_UNROTATED:g} (proportional RoPE)")
    return {"rope_parameters": {
        "sliding_attention": {"rope_type": "default",
                              "rope_theta": float(gf.fields.get(f"{arch}.rope.freq_base_swa", theta))},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 2 * rotated / global_head_dim,
                           "rope_theta": theta}}, "rope_scaling": None}


def _gemma4_experts(gf, arch: str, base: dict, layers: int, damaged) -> dict:
    # the MoE block beside every layer's MLP: llama.cpp runs a layer's experts where it has a router
    routed = [f"blk.{i}.ffn_gate_inp.weight" in gf.tensors for i in range(layers)]
    count = gf.fields.get(f"{arch}.expert_count")
    if not any(routed) and not count:
        return {"enable_moe_block": False, "num_experts": None, "top_k_experts": None, "moe_intermediate_size": None}
    if not all(routed) or not count:
        raise damaged(f"{arch}.expert_count={count!r} with a router in {sum(routed)} of {layers} layers (Gemma 4 "
                      f"routes every layer or none)")
    used = gf.field(f"{arch}.expert_used_count")
    if not 0 < used <= count:
        raise damaged(f"{arch}.expert_used_count={used} of {count} experts")
    return {"enable_moe_block": True, "num_experts": int(count), "top_k_experts": int(used),
            "moe_intermediate_size": int(gf.field(f"{arch}.expert_feed_forward_length"))}


_ARCH_FIELDS = {"gemma2": _gemma, "gemma3": _gemma, "phi3": _phi3, "llama": _llama, "qwen3moe": _qwen3moe,
                "gpt-oss": _gpt_oss, "smollm3": _smollm3, "qwen35": _qwen35, "qwen35moe": _qwen35, "gemma4": _gemma4}
