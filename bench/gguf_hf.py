"""A Hugging Face folder written as the GGUF llama.cpp's converter (convert_hf_to_gguf.py) and quantizer would make
of it: its weights under llama.cpp's names, its config as the arch's metadata keys, its byte-level BPE tokenizer.

The name, type and metadata rules are bench/gguf_writer.py's, shared with the random writer; a mixture of experts'
tensors are first read into kvchat's own names by the loader's expert_state (per-expert 2-D tensors stacked,
gpt-oss's interleaved gate | up taken apart), then stored as llama.cpp stores them: 3-D [experts, out, in], or one
2-D tensor per expert for Mixtral's older layout (per_expert=True; kvchat reads it, current llama.cpp no longer
does). Import it through bench.gguf_writer.

Two readings differ from transformers' in llama.cpp itself, not in the file: its YaRN rounds the ramp's ends to whole
dimensions (gpt-oss's config says truncate false; kvchat reads it so), and it has no key for a Qwen3-MoE that does
not renormalize its top-k weights (refused here, as the file would describe another model).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, RopeScalingType

from kvchat.bench.gguf_writer import (MIXES, QWEN35_ROPE_SECTIONS, _add_hybrid_keys, _add_moe_keys, _add_shape_keys,
                                      _add_yarn_keys, atomic_writer, file_type, permute, quantize, split_experts)

# llama.cpp's converter stores Gemma's and Qwen3.5's zero-centred RMSNorm weights as 1 + w (its norm multiplies by
# the stored weight); Qwen3.5's gated norm of the linear-attention output (linear_attn.norm) is a plain multiplier
_NORM_SHIFT = {"gemma2": 1.0, "gemma3": 1.0, "qwen35": 1.0, "qwen35moe": 1.0}
_PLAIN_NORMS = (".linear_attn.norm.weight",)
# what llama.cpp hard-codes for gpt-oss's clamped SwiGLU (a GGUF stores neither)
_GPT_OSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
# llama.cpp's smollm3 leaves RoPE out of every fourth layer (n_no_rope_layer_step; a GGUF does not store it)
_SMOLLM3_NO_ROPE_STEP = 4


def write_gguf_from_hf(folder: str | os.PathLike, path: str | os.PathLike, qtype: str = "F32",
                       per_expert: bool = False) -> Path:
    """Write a Hugging Face folder's model (its weights, config and byte-level BPE tokenizer) as the GGUF
    llama.cpp's converter and quantizer would make of it, in mix `qtype` (MIXES), and return the path.
    per_expert: a Mixtral's experts as one 2-D tensor each (blk.N.ffn_gate.E.weight), as its older GGUFs have them.

    A setting llama.cpp does not store but derives from the architecture (Gemma's query scale and window
    pattern, Gemma 3's local RoPE base, gpt-oss's window pattern and SwiGLU constants, SmolLM3's layers without
    RoPE, Qwen3-MoE's renormalized routing over experts in every layer, Qwen3.5's pattern of full-attention layers
    and its value heads as wide as its key heads) must be the one it derives: else a ValueError says which, since
    the file would describe another model. A Qwen3.5 (a text model's folder: Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM) is written as the converter's Qwen3_5 classes write it: A_log as A = -exp(A_log), the
    conv kernel [channels, kernel], zero-centred norms as 1 + w, value heads tiled (gguf_arch.tiled_value_heads),
    its MTP block left out (the converter's --no-mtp). A Gemma 4 text folder (Gemma4ForCausalLM) is written as the
    converter's Gemma4Model writes it (_write_gemma4).
    """
    from kvchat.engine.model.families import family
    from kvchat.engine.model.gguf_arch import tiled_value_heads
    from kvchat.engine.model.source import load_state_dict, read_config
    from kvchat.engine.model.weights import expert_state, linear_state

    folder, path = Path(folder), Path(path)
    if qtype not in MIXES:
        raise ValueError(f"unknown type {qtype!r}: one of {', '.join(MIXES)}")
    cfg = read_config(folder)
    if cfg.get("model_type") == "gemma4_text":
        return _write_gemma4(folder, path, qtype, cfg)
    linear = ({"key_heads": cfg["linear_num_key_heads"], "value_heads": cfg["linear_num_value_heads"],
               "key_dim": cfg["linear_key_head_dim"], "value_dim": cfg["linear_value_head_dim"]}
              if "linear_num_value_heads" in cfg else None)
    fam = family(cfg.get("model_type"), str(folder / "config.json"))
    arch = fam.gguf_arch
    layers, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    local = rope.get("sliding_attention") if arch == "gemma3" else None
    if arch == "gemma3":
        rope = rope.get("full_attention", {})
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rotary = int(head_dim * rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    rtype = rope.get("rope_type", rope.get("type", "default")) or "default"
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    expert_ffn = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    if per_expert and not (experts and arch == "llama"):
        raise ValueError(f"{folder.name}: one tensor per expert is Mixtral's older layout (arch llama with experts); "
                         f"llama.cpp reads {arch} experts only as 3-D tensors")

    def derived(what: str, have, llama_cpp) -> None:
        if have != llama_cpp:
            raise ValueError(f"{folder.name}: {what} is {have!r}, but llama.cpp derives {llama_cpp!r} for {arch} "
                             f"(a GGUF does not store it): the file would describe another model")

    _check_derived(arch, cfg, rope, local, layers, hidden, heads, head_dim, derived)
    # a Qwen3.5's multi-token-prediction block (mtp.*) is left out, as the converter's --no-mtp leaves it
    state = {k: v for k, v in load_state_dict(folder).items() if not k.startswith("mtp.")}
    if experts or cfg.get("model_type") == "gpt_oss":
        state = expert_state(cfg["model_type"], state)
    linear_state(state)         # a Gated DeltaNet's A_log, dt_bias, conv1d as kvchat's A, dt.bias, [channels, kernel]
    tied = bool(cfg.get("tie_word_embeddings", False)) or "lm_head.weight" not in state
    if tied and arch in _OUTPUT_REQUIRED:
        # llama.cpp reads gpt-oss's output head as its own tensor: a tied folder's embedding is written there too
        state["lm_head.weight"], tied = state["model.embed_tokens.weight"], False
    with atomic_writer(path, arch) as writer:
        writer.add_name(folder.name)
        _add_shape_keys(writer, arch, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                        ffn=cfg.get("intermediate_size"), head_dim=head_dim,
                        context=cfg.get("max_position_embeddings", 4096), theta=theta,
                        eps=cfg.get("rms_norm_eps", 1e-6), rotary_dims=rotary)
        _add_moe_keys(writer, arch, experts, cfg.get("num_experts_per_tok", 0), expert_ffn)
        if linear:
            _add_hybrid_keys(writer, **linear, kernel=cfg["linear_conv_kernel_dim"],
                             every=cfg.get("full_attention_interval", 4),
                             sections=tuple(rope.get("mrope_section", QWEN35_ROPE_SECTIONS[:3])),
                             shared_ffn=cfg.get("shared_expert_intermediate_size", 0))
        if rtype == "linear":
            writer.add_rope_scaling_type(RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(rope["factor"]))
        elif rtype == "longrope":
            original = int(rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"])
            scale = cfg["max_position_embeddings"] / original
            # the converter's attention factor where the config gives none (as transformers computes it)
            factor = rope.get("attention_factor") or (
                1.0 if scale <= 1.0 else float(np.sqrt(1 + np.log(scale) / np.log(original))))
            writer.add_rope_scaling_attn_factors(float(factor))
            writer.add_rope_scaling_orig_ctx_len(original)
        elif rtype == "yarn" and arch == "gpt-oss":
            _add_yarn_keys(writer, rope["factor"], rope.get("original_max_position_embeddings", 4096),
                           rope.get("beta_fast", 32.0), rope.get("beta_slow", 1.0))
        elif rtype != "default":
            raise ValueError(f"{folder.name}: rope type {rtype!r} is not written here (default, linear, longrope; "
                             f"yarn for gpt-oss)")
        if arch in ("gemma2", "gemma3", "gpt-oss") and cfg.get("sliding_window"):
            writer.add_sliding_window(int(cfg["sliding_window"]))
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(float(cfg["attn_logit_softcapping"]))
            writer.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
        if arch == "gemma3" and cfg.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
        if arch == "phi3" and cfg.get("sliding_window"):
            writer.add_sliding_window(int(cfg["sliding_window"]))
        writer.add_file_type(int(MIXES[qtype][2]))
        writer.add_quantization_version(2)
        for key, value, vtype, sub in hf_tokenizer_fields(folder):
            writer.add_key_value(key, value, vtype, sub)

        if rtype == "longrope":     # one divisor per rotated frequency, F32, as the converter writes them
            for kind in ("long", "short"):
                writer.add_tensor(f"rope_factors_{kind}.weight", np.asarray(rope[f"{kind}_factor"], dtype=np.float32))
        permuted = {"self_attn.q_proj": heads, "self_attn.k_proj": kv_heads} if fam.gguf_permuted_qk else {}
        shift = _NORM_SHIFT.get(arch, 0.0)
        for name, t in state.items():
            if name == "lm_head.weight" and tied:
                continue
            a = t.float().numpy()
            gname, module = _gguf_name(name, fam.gguf_tensors)
            if module in permuted:
                a = permute(a, permuted[module]) if a.ndim == 2 else permute(a[:, None], permuted[module])[:, 0]
            if shift and name.endswith("norm.weight") and not name.endswith(_PLAIN_NORMS):
                a = a + np.float32(shift)
            order = tiled_value_heads(name, **linear) if linear else None
            if order is not None:           # transformers' value-head order -> llama.cpp's tiled one
                a = np.take(a, np.argsort(order[1]), axis=order[0])
            parts = split_experts(gname, a.shape) if per_expert and a.ndim == 3 else [(gname, a.shape)]
            for e, (part, dims) in enumerate(parts):
                _add(writer, part, a[e] if len(parts) > 1 else a, file_type(qtype, part, dims, layers, tied, experts))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    return path


def _write_gemma4(folder: Path, path: Path, qtype: str, cfg: dict) -> Path:
    """A Gemma 4 text folder (Gemma4ForCausalLM) as llama.cpp's converter (its Gemma4Model) writes it: every tensor
    as it is (no norm shifted: Gemma4RMSNorm multiplies by w), under gguf_arch.GEMMA4_* names, the full layers'
    proportional RoPE as rope_freqs, the per-layer pattern, head widths, KV head counts and MLP widths as the
    header's arrays; the folder's byte-level BPE tokenizer as the others' (the converter writes Gemma's own)."""
    from kvchat.engine.model.gguf_arch import GEMMA4_ROPE_FREQS, GEMMA4_UNROTATED
    from kvchat.engine.model.source import load_state_dict

    g = _gemma4_shape(folder.name, cfg)
    state = load_state_dict(folder)
    tied = bool(cfg.get("tie_word_embeddings", True)) or "lm_head.weight" not in state
    tokenizer = hf_tokenizer_fields(folder)
    tokens = len(next(value for key, value, _, _ in tokenizer if key == "tokenizer.ggml.tokens"))
    if tokens != cfg["vocab_size"]:
        raise ValueError(f"{folder.name}: the tokenizer has {tokens} tokens, the embedding {cfg['vocab_size']} rows "
                         f"(llama.cpp reads one row a token)")
    layers, experts = g["layers"], cfg.get("num_experts") or 0
    with atomic_writer(path, "gemma4") as w:
        w.add_name(folder.name)
        w.add_block_count(layers)
        w.add_context_length(cfg.get("max_position_embeddings", 131072))
        w.add_embedding_length(cfg["hidden_size"])
        w.add_feed_forward_length(g["ffn"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv(g["kv_heads"])
        w.add_rope_freq_base(g["theta"])
        w.add_rope_freq_base_swa(g["theta_swa"])
        w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
        if cfg.get("enable_moe_block"):
            w.add_expert_count(experts)
            w.add_expert_used_count(cfg["top_k_experts"])
        w.add_key_length(g["global_head_dim"])
        w.add_value_length(g["global_head_dim"])
        w.add_key_length_swa(g["head_dim"])
        w.add_value_length_swa(g["head_dim"])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
        w.add_sliding_window(int(cfg.get("sliding_window", 512)))
        w.add_shared_kv_layers(g["shared"])
        w.add_embedding_length_per_layer_input(cfg.get("hidden_size_per_layer_input") or 0)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in g["types"]])
        if cfg.get("enable_moe_block"):
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_rope_dimension_count(g["global_head_dim"])
        w.add_rope_dimension_count_swa(g["head_dim"])
        w.add_file_type(int(MIXES[qtype][2]))
        w.add_quantization_version(2)
        for key, value, vtype, sub in tokenizer:
            w.add_key_value(key, value, vtype, sub)

        rotated = int(g["global_head_dim"] * g["partial"]) // 2
        w.add_tensor(GEMMA4_ROPE_FREQS, np.array([1.0] * rotated + [GEMMA4_UNROTATED] * (g["global_head_dim"] // 2
                                                                                          - rotated), np.float32))
        for name, t in state.items():
            if name == "lm_head.weight" and tied:
                continue
            gname = gemma4_gguf_name(name)
            a = t.float().numpy()
            _add(w, gname, a, file_type(qtype, gname, a.shape, layers, tied, experts))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    return path


def gemma4_gguf_name(hf_name: str) -> str:
    """llama.cpp's name of a Gemma 4 checkpoint's tensor (transformers' names; gguf_arch.GEMMA4_HF_NAMES)."""
    from kvchat.engine.model.gguf_arch import (GEMMA4_HF_NAMES, GEMMA4_MODEL_TENSORS, GEMMA4_RENAMED, GEMMA4_TENSORS,
                                               gguf_tensor_name)
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight", **GEMMA4_MODEL_TENSORS}
    if hf_name in top:
        return top[hf_name]
    _, _, i, rest = hf_name.split(".", 3)
    rest = GEMMA4_HF_NAMES.get(rest, rest)
    if rest in GEMMA4_RENAMED:
        return f"blk.{i}.{GEMMA4_RENAMED[rest]}"
    module, kind = rest.rsplit(".", 1)
    if module not in GEMMA4_TENSORS:
        raise ValueError(f"weight {hf_name}: llama.cpp's gemma4 has no tensor for {module!r}")
    return gguf_tensor_name(i, GEMMA4_TENSORS[module], kind)


def _gemma4_shape(name: str, cfg: dict) -> dict:
    """What the converter writes of a Gemma 4 config.json (its published keys global_head_dim and
    num_global_key_value_heads, or transformers' per_layer_config that replaces them when it saves one), and a
    ValueError where llama.cpp would run another model than transformers."""
    from kvchat.engine.model.gguf_arch import GEMMA2_FINAL_SOFTCAP
    layers = cfg["num_hidden_layers"]
    types = list(cfg.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                           for i in range(layers)])
    types[-1] = "full_attention"        # transformers' Gemma4TextConfig forces it
    full = next((v for k, v in (cfg.get("per_layer_config") or {}).items() if types[int(k)] == "full_attention"), {})
    kv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    named = cfg.get("num_global_key_value_heads")
    full_kv = full.get("num_key_value_heads") or (named if k_eq_v and named else kv)
    shared = cfg.get("num_kv_shared_layers", 0)
    rope = cfg.get("rope_parameters") or {}
    local, glob = rope.get("sliding_attention") or {}, rope.get("full_attention") or {}

    def derived(what: str, have, llama_cpp) -> None:
        if have != llama_cpp:
            raise ValueError(f"{name}: {what} is {have!r}, but llama.cpp's gemma4 reads {llama_cpp!r} (a GGUF does "
                             f"not store it): the file would describe another model")

    if named:       # the converter gives the full layers num_global_key_value_heads; transformers only with k_eq_v
        derived("the full layers' KV heads", full_kv, named)
    derived("the sliding layers' rope_type", local.get("rope_type", "default"), "default")
    derived("the full layers' rope_type", glob.get("rope_type", "proportional"), "proportional")
    derived("the full layers' rope factor", glob.get("factor", 1.0), 1.0)
    # the converter writes no cap where the config has none, and llama.cpp then caps at 30 (its Gemma 2 default)
    derived("final_logit_softcapping", cfg.get("final_logit_softcapping"),
            cfg.get("final_logit_softcapping") or GEMMA2_FINAL_SOFTCAP)
    derived("use_bidirectional_attention", cfg.get("use_bidirectional_attention"), None)
    derived("attention_bias", bool(cfg.get("attention_bias", False)), False)
    derived("hidden_activation", cfg.get("hidden_activation", "gelu_pytorch_tanh"), "gelu_pytorch_tanh")
    # llama.cpp's KV-shared layers read the cache of layer first_shared - 1 (full) or - 2 (sliding); transformers' the
    # last earlier layer of their kind: the same layers where the last two unshared ones are sliding, then full
    first = layers - shared
    for kind, back in (("full_attention", 1), ("sliding_attention", 2)):
        if shared and kind in types[first:]:
            derived(f"the KV-shared {kind} layers' source layer",
                    max((i for i in range(first) if types[i] == kind), default=None), first - back)
    if cfg.get("hidden_size_per_layer_input"):
        derived("vocab_size_per_layer_input", cfg.get("vocab_size_per_layer_input"), cfg["vocab_size"])
    ffn = cfg["intermediate_size"]
    return {"layers": layers, "types": types, "shared": shared, "head_dim": cfg.get("head_dim", 256),
            "global_head_dim": full.get("head_dim") or cfg.get("global_head_dim") or 512,
            "kv_heads": ([kv if t == "sliding_attention" else full_kv for t in types] if named or full_kv != kv
                         else kv),
            "ffn": ([ffn if i < layers - shared else 2 * ffn for i in range(layers)]
                    if cfg.get("use_double_wide_mlp") else ffn),
            "theta": float(glob.get("rope_theta", 1e6)), "theta_swa": float(local.get("rope_theta", 1e4)),
            "partial": float(glob.get("partial_rotary_factor", 0.25))}


# the architectures whose output head llama.cpp requires as a tensor of its own (no fallback to the embedding)
_OUTPUT_REQUIRED = {"gpt-oss"}


def _add(writer, name: str, a: np.ndarray, kind: str) -> None:
    """One tensor in its file type: matrices and expert stacks quantized by rows, 1-D tensors as float32."""
    if a.ndim == 1:
        writer.add_tensor(name, np.ascontiguousarray(a))
        return
    data = quantize(np.ascontiguousarray(a.reshape(-1, a.shape[-1])), kind)
    data = data.reshape(*a.shape[:-1], data.shape[-1])
    writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=GGMLQuantizationType[kind])


def _check_derived(arch: str, cfg: dict, rope: dict, local, layers: int, hidden: int, heads: int, head_dim: int,
                   derived) -> None:
    """The folder's settings llama.cpp derives for its arch instead of reading them must be the derived ones."""
    from kvchat.engine.model.gguf_arch import GEMMA3_LOCAL_THETA, layer_types, query_pre_attn_scalar
    if arch in ("gemma2", "gemma3"):
        derived("query_pre_attn_scalar", cfg.get("query_pre_attn_scalar", head_dim),
                query_pre_attn_scalar(arch, layers, hidden, heads, head_dim))
        expected = layer_types(arch, layers, bool(cfg.get("sliding_window")))
        derived("layer_types", list(cfg.get("layer_types") or expected), expected)
    if arch == "gemma3":
        derived("the sliding layers' rope", (local or {}).get("rope_theta", GEMMA3_LOCAL_THETA), GEMMA3_LOCAL_THETA)
    if arch == "qwen3moe":
        # llama.cpp's qwen3moe routes every layer and renormalizes the top-k weights (build_moe_ffn, norm_w true)
        derived("norm_topk_prob", bool(cfg.get("norm_topk_prob", False)), True)
        derived("mlp_only_layers", list(cfg.get("mlp_only_layers") or []), [])
        derived("decoder_sparse_step", cfg.get("decoder_sparse_step", 1), 1)
    if arch == "gpt-oss":
        # llama.cpp's swa pattern 2: the even layers slide, from layer 0
        window = bool(cfg.get("sliding_window"))
        expected = ["sliding_attention" if window and i % 2 == 0 else "full_attention" for i in range(layers)]
        derived("layer_types", list(cfg.get("layer_types") or expected), expected)
        for key, value in _GPT_OSS_SWIGLU.items():
            derived(key, float(cfg.get(key, value)), value)
        derived("yarn truncate", rope.get("truncate", True) if rope.get("rope_type") == "yarn" else False, False)
        derived("yarn attention_factor", rope.get("attention_factor"), None)
    if arch in ("qwen35", "qwen35moe"):
        # llama.cpp's qwen35: every full_attention_interval-th layer full (the converter writes 4 where the config
        # names none), one head width for keys and values (ssm.state_size)
        every = cfg.get("full_attention_interval", 4)
        expected = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
        derived("layer_types", list(cfg.get("layer_types") or expected), expected)
        derived("linear_value_head_dim", cfg["linear_value_head_dim"], cfg["linear_key_head_dim"])
    if arch == "smollm3":
        step = _SMOLLM3_NO_ROPE_STEP
        expected = [int((i + 1) % step != 0) for i in range(layers)]
        derived("no_rope_layers", list(cfg.get("no_rope_layers") or expected), expected)
        derived("use_sliding_window", bool(cfg.get("use_sliding_window", False)), False)


def _gguf_name(hf_name: str, tensors: dict[str, str]) -> tuple[str, str | None]:
    """(llama.cpp's name, the layer module or None) of a Hugging Face weight (a mixture of experts' under kvchat's
    names: engine.model.weights.expert_state)."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name], None
    _, _, i, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    if module not in tensors:
        raise ValueError(f"weight {hf_name}: llama.cpp has no tensor for {module!r} in this architecture")
    from kvchat.engine.model.gguf_arch import gguf_tensor_name
    return gguf_tensor_name(i, tensors[module], kind), module


def hf_tokenizer_fields(folder: Path) -> list[tuple[str, object, GGUFValueType, GGUFValueType | None]]:
    """A folder's byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json, its chat template) as the
    tokenizer.* fields llama.cpp's converter writes: model gpt2, pre-tokenizer gpt-2, every token with its
    type (special added tokens CONTROL, other added ones USER_DEFINED), the merges, the special ids."""
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    model = spec["model"]
    if model.get("type") != "BPE" or (spec.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
        raise ValueError(f"{folder.name}: only a byte-level BPE tokenizer is written here")
    vocab = dict(model["vocab"])
    kinds = {}
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        kinds[added["id"]] = 3 if added.get("special") else 4
    tokens = [None] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    if any(t is None for t in tokens):
        raise ValueError(f"{folder.name}: the vocabulary's ids are not 0..{len(tokens) - 1}")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    S, A, U32, I32, B = (GGUFValueType.STRING, GGUFValueType.ARRAY, GGUFValueType.UINT32, GGUFValueType.INT32,
                         GGUFValueType.BOOL)
    out = [("tokenizer.ggml.model", "gpt2", S, None), ("tokenizer.ggml.pre", "gpt-2", S, None),
           ("tokenizer.ggml.tokens", tokens, A, S),
           ("tokenizer.ggml.token_type", [kinds.get(i, 1) for i in range(len(tokens))], A, I32),
           ("tokenizer.ggml.merges", merges, A, S)]
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        text = config.get(name)
        text = text.get("content") if isinstance(text, dict) else text
        if text in vocab:
            out.append((f"tokenizer.ggml.{key}", vocab[text], U32, None))
    post = spec.get("post_processor") or {}
    single = post.get("single", []) if post.get("type") == "TemplateProcessing" else []
    out.append(("tokenizer.ggml.add_bos_token", bool(single) and "SpecialToken" in single[0], B, None))
    template = folder / "chat_template.jinja"
    text = template.read_text(encoding="utf-8") if template.is_file() else config.get("chat_template")
    if text:
        out.append(("tokenizer.chat_template", text, S, None))
    return out
