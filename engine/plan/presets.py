"""Published models by name, for `kvchat estimate --model <preset>` and anything else that plans without a file.

Each preset is the model's config.json as its Hugging Face repository publishes it (only the fields the
description reads), so a preset becomes a ModelConfig through ModelConfig.from_hf like a downloaded folder
would, with its family's per-layer description (which layers slide, over what window). A preset is built
when it is first asked for: one whose family this build does not run is a ModelLoadError for that preset
alone, never for the others.
"""
from __future__ import annotations

from functools import cache

from kvchat.engine.model.config import ModelConfig


def _llama(vocab, hidden, layers, heads, kv_heads, intermediate, context, tie, theta, model_type="llama",
           rope_scaling=None) -> dict:
    cfg = {"model_type": model_type, "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": intermediate,
           "max_position_embeddings": context, "tie_word_embeddings": tie, "rope_theta": theta,
           "rms_norm_eps": 1e-5}
    if rope_scaling:
        cfg["rope_scaling"] = rope_scaling
    return cfg


# Llama 3.1's published rope_scaling (the 8B and 70B repositories carry the same)
_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}


def _qwen3(hidden, layers, heads, intermediate, tie) -> dict:
    # Qwen/Qwen3-*: vocab 151936, 8 KV heads, head_dim 128 apart from hidden / heads, context 40960,
    # rope_theta 1e6, rms_norm_eps 1e-6, no sliding window (use_sliding_window false)
    return {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": intermediate, "max_position_embeddings": 40960, "tie_word_embeddings": tie,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "attention_bias": False, "use_sliding_window": False,
            "sliding_window": None}


def _gemma3(vocab, hidden, layers, heads, kv_heads, head_dim, intermediate, window, context, query_scalar,
            rope_scaling) -> dict:
    # google/gemma-3-*: the text model's fields (the 4B / 12B / 27B repositories hold them as text_config of
    # a multimodal "gemma3" config; the 1B is gemma3_text itself). Five sliding layers then one global, the
    # sliding ones on RoPE base 10,000 (rope_local_base_freq), the global ones on 1e6 with rope_scaling.
    return {"model_type": "gemma3_text", "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "intermediate_size": intermediate, "max_position_embeddings": context, "tie_word_embeddings": True,
            "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": rope_scaling,
            "rms_norm_eps": 1e-6, "query_pre_attn_scalar": query_scalar, "sliding_window": window,
            "sliding_window_pattern": 6,
            "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
            "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": None,
            "final_logit_softcapping": None, "attention_bias": False}


_GEMMA3_LONG = {"rope_type": "linear", "factor": 8.0}


def _qwen3_5(hidden, layers, kv_heads, tie, mlp: dict) -> dict:
    # Qwen/Qwen3.5-*: the text_config of the multimodal repository (its own model_type *_text): three Gated DeltaNet
    # layers (16 key heads, 32 value heads, each 128 wide, a conv of 4) then one gated attention layer of 16 heads
    # of 256, a quarter of each rotated at rope_theta 1e7; vocabulary 248320, 262,144 positions
    return {"model_type": "qwen3_5_moe_text" if "num_experts" in mlp else "qwen3_5_text", "vocab_size": 248320,
            "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": 16,
            "num_key_value_heads": kv_heads, "head_dim": 256, "max_position_embeddings": 262144,
            "tie_word_embeddings": tie, "rms_norm_eps": 1e-6, "attention_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": True},
            "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, **mlp}

# microsoft/Phi-4-mini-instruct's LongRoPE factors (config.json rope_scaling, 48 = 96 rotated dims / 2)
_PHI4_MINI_LONG = (1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649,
                   2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845,
                   5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158,
                   11.70738129, 13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105,
                   25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71,
                   32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77)


# name -> config.json fields, from each model's Hugging Face repository (named in the comment)
PRESET_CONFIGS: dict[str, dict] = {
    # meta-llama/Llama-2-7b-hf: the README's "7B with 32 KV heads" (no grouped-query attention)
    "llama-2-7b": _llama(32000, 4096, 32, 32, 32, 11008, 4096, False, 10000.0),
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": _llama(128256, 4096, 32, 32, 8, 14336, 131072, False, 500000.0, rope_scaling=_LLAMA31_ROPE),
    # meta-llama/Llama-3.1-70B
    "llama-3.1-70b": _llama(128256, 8192, 80, 64, 8, 28672, 131072, False, 500000.0, rope_scaling=_LLAMA31_ROPE),
    # meta-llama/Meta-Llama-3-70B: as 3.1 with max_position_embeddings 8192 and no rope scaling
    "llama-3-70b": _llama(128256, 8192, 80, 64, 8, 28672, 8192, False, 500000.0),
    # Qwen/Qwen2.5-7B (q, k, v carry a bias)
    "qwen2.5-7b": _llama(152064, 3584, 28, 28, 4, 18944, 131072, False, 1000000.0, model_type="qwen2"),
    # mistralai/Mistral-7B-v0.3
    "mistral-7b-v0.3": _llama(32768, 4096, 32, 32, 8, 14336, 32768, False, 1000000.0, model_type="mistral"),
    # HuggingFaceTB/SmolLM2-135M / -360M / -1.7B
    "smollm2-135m": _llama(49152, 576, 30, 9, 3, 1536, 8192, True, 100000.0),
    "smollm2-360m": _llama(49152, 960, 32, 15, 5, 2560, 8192, True, 100000.0),
    "smollm2-1.7b": _llama(49152, 2048, 24, 32, 32, 8192, 8192, True, 130000.0),
    # Qwen/Qwen3-0.6B, -4B (tied embeddings), -8B, -32B
    "qwen3-0.6b": _qwen3(1024, 28, 16, 3072, True),
    "qwen3-4b": _qwen3(2560, 36, 32, 9728, True),
    "qwen3-8b": _qwen3(4096, 36, 32, 12288, False),
    "qwen3-32b": _qwen3(5120, 64, 64, 25600, False),
    # google/gemma-3-1b-pt: window 512, context 32768, no rope scaling
    "gemma-3-1b": _gemma3(262144, 1152, 26, 4, 1, 256, 6912, 512, 32768, 256, None),
    # google/gemma-3-4b-pt, -12b-pt, -27b-pt (text_config): window 1024, context 131072, linear rope x8
    "gemma-3-4b": _gemma3(262208, 2560, 34, 8, 4, 256, 10240, 1024, 131072, 256, _GEMMA3_LONG),
    "gemma-3-12b": _gemma3(262208, 3840, 48, 16, 8, 256, 15360, 1024, 131072, 256, _GEMMA3_LONG),
    "gemma-3-27b": _gemma3(262208, 5376, 62, 32, 16, 128, 21504, 1024, 131072, 168, _GEMMA3_LONG),
    # microsoft/Phi-4-mini-instruct: 3/4 of each head rotated, LongRoPE past 4,096 positions; its
    # sliding_window (262,144) is longer than its context, so every layer attends to everything
    "phi-4-mini": {"model_type": "phi3", "vocab_size": 200064, "hidden_size": 3072, "num_hidden_layers": 32,
                   "num_attention_heads": 24, "num_key_value_heads": 8, "intermediate_size": 8192,
                   "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                   "tie_word_embeddings": True, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
                   "partial_rotary_factor": 0.75, "sliding_window": 262144, "attention_bias": False,
                   "rope_scaling": {"type": "longrope", "long_factor": list(_PHI4_MINI_LONG),
                                    "short_factor": [1.0] * len(_PHI4_MINI_LONG)}},
    # mixtures of experts: every expert is held, a token reads only the `num_experts_per_tok` its router picks.
    # Qwen/Qwen3-30B-A3B: 128 experts of 768, 8 used and renormalized, every layer routed (intermediate_size is
    # the unused dense size)
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                      "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "max_position_embeddings": 40960, "tie_word_embeddings": False, "rope_theta": 1000000.0,
                      "rms_norm_eps": 1e-6, "attention_bias": False, "use_sliding_window": False,
                      "sliding_window": None},
    # openai/gpt-oss-20b: 32 experts of 2880, 4 used; sliding (128) and full layers alternate from layer 0; YaRN
    # x32 over 4,096 positions; biased attention with learned sink logits
    "gpt-oss-20b": {"model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "num_hidden_layers": 24,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880,
                    "num_local_experts": 32, "num_experts_per_tok": 4, "max_position_embeddings": 131072,
                    "tie_word_embeddings": False, "rope_theta": 150000, "rms_norm_eps": 1e-5,
                    "attention_bias": True, "sliding_window": 128, "swiglu_limit": 7.0,
                    "layer_types": ["sliding_attention", "full_attention"] * 12,
                    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "original_max_position_embeddings": 4096, "truncate": False}},
    # mistralai/Mixtral-8x7B-v0.1 (-Instruct-v0.1 the same): 8 experts of 14336, 2 used
    "mixtral-8x7b": {**_llama(32000, 4096, 32, 32, 8, 14336, 32768, False, 1000000.0, model_type="mixtral"),
                     "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None},
    # hybrids of linear attention (a recurrent state of the same bytes at any length) and full attention: only
    # every fourth layer keeps a KV cache. Qwen/Qwen3.5-9B: 32 layers of 4096, 4 KV heads, intermediate 12288
    "qwen3.5-9b": _qwen3_5(4096, 32, 4, False, {"intermediate_size": 12288}),
    # Qwen/Qwen3.5-35B-A3B: 40 layers of 2048, 2 KV heads; every layer 256 experts of 512 (8 used, renormalized)
    # beside a shared expert of 512 behind its sigmoid gate
    "qwen3.5-35b-a3b": _qwen3_5(2048, 40, 2, False, {"num_experts": 256, "num_experts_per_tok": 8,
                                                     "moe_intermediate_size": 512,
                                                     "shared_expert_intermediate_size": 512}),
    # google/gemma-4-E4B (its text_config): 42 layers of 2560, five sliding (512, heads of 256, RoPE 10,000) to one
    # global (heads of 512, a quarter of them turning at 1e6), the last 18 layers reading the KV of layers 22 / 23,
    # per-layer input embeddings of 256 per layer over the 262,144-token vocabulary, a final soft-cap of 30
    "gemma-4-e4b": {"model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 2560, "num_hidden_layers": 42,
                    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "global_head_dim": 512,
                    "intermediate_size": 10240, "max_position_embeddings": 131072, "tie_word_embeddings": True,
                    "rms_norm_eps": 1e-6, "sliding_window": 512, "num_kv_shared_layers": 18,
                    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(42)],
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                           "rope_theta": 1000000.0}},
                    "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144,
                    "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
                    "attention_bias": False, "attention_k_eq_v": False, "enable_moe_block": False},
}


def preset_names() -> tuple[str, ...]:
    return tuple(PRESET_CONFIGS)


@cache
def preset(name: str) -> ModelConfig:
    """The ModelConfig of a preset, built through the family registry; a ModelLoadError for a family this build
    does not run (its message names the architecture)."""
    return ModelConfig.from_hf(PRESET_CONFIGS[name], f"the {name} preset")
