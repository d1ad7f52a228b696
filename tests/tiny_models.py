"""Tiny random-weight models for fast tests: a real HF folder (config.json, safetensors, tokenizer).

Everything is made here; nothing comes from a hub.
"""
from __future__ import annotations

import json
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello! How are you today? I am fine, thank you.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    "Caches store keys and values for every token of the conversation.",
    "Ünïcödé tëxt, emoji 🙂 and 日本語 too.",
]


def random_ids(engine, n: int, seed: int = 0) -> list[int]:
    """n reproducible token ids from an engine's vocabulary, special ids 0-2 excluded."""
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, engine.model.config.vocab_size, (n,), generator=g).tolist()


def build_tokenizer(folder: Path, vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def tiny_model_dir(path, arch: str = "llama", hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                   intermediate: int = 128, tie: bool = True, seed: int = 0, head_dim: int | None = None,
                   max_positions: int = 2048) -> str:
    """Write a random-weight model of `arch` (llama, mistral, qwen2) into path; returns the folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder)
    extra = {"head_dim": head_dim} if head_dim else {}
    config = AutoConfig.for_model(
        arch, vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=intermediate, tie_word_embeddings=tie,
        max_position_embeddings=max_positions, rms_norm_eps=1e-5, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():   # larger than default init so attention patterns are not flat
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
            else:
                p.uniform_(0.8, 1.2)
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder)


def write_bad_folder(path, model_type: str) -> str:
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 8}))
    return str(folder)


# every feature of each family on by default (see tiny_family_dir); vocab 320 is build_tokenizer's
_FAMILY_DEFAULTS = {
    # head_dim 32 with hidden 64 / 4 heads: head_dim != hidden / heads
    "qwen3": dict(num_hidden_layers=2, head_dim=32, num_key_value_heads=2),
    # 4 layers alternating sliding / full; query_pre_attn_scalar 24: the query scale is not head_dim ** -0.5
    "gemma2": dict(num_hidden_layers=4, head_dim=32, num_key_value_heads=2, query_pre_attn_scalar=24,
                   sliding_window=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   layer_types=["sliding_attention", "full_attention"] * 2),
    # 6 layers: 5 sliding then 1 full, each kind with its own rope (the full one linearly scaled by 8)
    "gemma3": dict(num_hidden_layers=6, head_dim=32, num_key_value_heads=1, query_pre_attn_scalar=24,
                   sliding_window=16, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                       "rope_theta": 1000000.0}}),
    "phi3": dict(num_hidden_layers=2, num_key_value_heads=2, sliding_window=None),
    # mixtures of experts. Qwen3-MoE: 8 experts, 3 used, not renormalized, layer 1 dense (mlp_only_layers)
    "qwen3_moe": dict(num_hidden_layers=3, head_dim=32, num_key_value_heads=2, num_experts=8, num_experts_per_tok=3,
                      moe_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False),
    "mixtral": dict(num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                    intermediate_size=64),
    # gpt-oss: sliding / full alternating over window 16, sink logits, biases, YaRN (its published factor 32 over
    # 4,096), the clamped SwiGLU
    "gpt_oss": dict(num_hidden_layers=4, head_dim=32, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=64, sliding_window=16, max_position_embeddings=131072,
                    layer_types=["sliding_attention", "full_attention"] * 2),
    # SmolLM3: layer 3 of 4 without RoPE
    "smollm3": dict(num_hidden_layers=4, num_key_value_heads=2, no_rope_layer_interval=4),
    # Qwen3.5: Gated DeltaNet and gated full attention alternating; 6 value heads over 2 key heads (6 does not divide
    # the 4 attention heads), a conv of 4 taps, head_dim 32 rotated over its first 8 dimensions (1/4)
    "qwen3_5": dict(num_hidden_layers=4, head_dim=32, num_key_value_heads=2, layer_types=["linear_attention",
                    "full_attention"] * 2, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
                    linear_value_head_dim=8, linear_conv_kernel_dim=4),
    # Qwen3.5-MoE: the same, every MLP 8 experts (3 used) and a shared expert
    "qwen3_5_moe": dict(num_hidden_layers=4, head_dim=32, num_key_value_heads=2, layer_types=["linear_attention",
                        "full_attention"] * 2, linear_num_key_heads=2, linear_num_value_heads=6,
                        linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8,
                        num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=48),
    # Gemma 4: sliding (head 16, window 8) and global (head 32, twice) layers, a proportional rope on the global ones,
    # the last two layers over the KV of layers 3 (sliding, right before) and 2 (global), per-layer input embeddings
    # of 8 per layer, a final soft-cap
    "gemma4": dict(num_hidden_layers=6, head_dim=16, global_head_dim=32, num_key_value_heads=2, sliding_window=8,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                   num_kv_shared_layers=2, hidden_size_per_layer_input=8, final_logit_softcapping=30.0),
}


def tiny_family_dir(path, family: str, seed: int = 0, longrope: bool = False, **overrides) -> str:
    """Write a random-weight Hugging Face folder (config.json, model.safetensors, build_tokenizer's tokenizer) of
    `family` ("qwen3", "gemma2", "gemma3" as model_type gemma3_text, "phi3", and the mixtures of experts
    "qwen3_moe", "mixtral", "gpt_oss", with "smollm3"), float32, from transformers' own
    config class and *ForCausalLM; returns the folder. Small but exercising every feature of the family (see
    _FAMILY_DEFAULTS); the weights are large (std 0.2) and the norm weights random, so that each feature, and a
    (1 + w) against w norm, moves the logits. longrope (phi3): LongRoPE short / long factors over an original
    context of 64 positions, max_position_embeddings 256. Overrides go to the config."""
    import torch
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GptOssConfig,
                              GptOssForCausalLM, MixtralConfig, MixtralForCausalLM, Phi3Config, Phi3ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM, SmolLM3Config,
                              SmolLM3ForCausalLM)

    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    classes = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "gemma2": (Gemma2Config, Gemma2ForCausalLM),
               "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
               "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM),
               "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM), "phi3": (Phi3Config, Phi3ForCausalLM),
               "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM), "mixtral": (MixtralConfig, MixtralForCausalLM),
               "gpt_oss": (GptOssConfig, GptOssForCausalLM), "smollm3": (SmolLM3Config, SmolLM3ForCausalLM),
               "gemma4": (Gemma4TextConfig, Gemma4ForCausalLM)}
    if family not in classes:
        raise ValueError(f"family {family!r}: one of {', '.join(classes)}")
    config_cls, model_cls = classes[family]
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder)
    fields = dict(vocab_size=len(tok), hidden_size=64, num_attention_heads=4, intermediate_size=128,
                  tie_word_embeddings=True, max_position_embeddings=2048, rms_norm_eps=1e-5, initializer_range=0.2,
                  eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    fields.update(_FAMILY_DEFAULTS[family])
    if family == "gemma4":
        fields["vocab_size_per_layer_input"] = len(tok)
    if longrope:
        rotary_half = 64 // 4 // 2
        g = torch.Generator().manual_seed(seed + 1)
        short = (1.0 + torch.rand(rotary_half, generator=g)).tolist()
        long = (1.0 + 4 * torch.rand(rotary_half, generator=g)).tolist()
        fields.update(max_position_embeddings=256, original_max_position_embeddings=64,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short,
                                       "long_factor": long})
    fields.update(overrides)
    config = config_cls(**fields)
    torch.manual_seed(seed)
    model = model_cls(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:    # around 0 for (1 + w) norms, around 1 for w norms: never all ones
                centred = (family.startswith("gemma") and family != "gemma4") or (
                    family.startswith("qwen3_5") and "linear_attn" not in name)
                p.uniform_(-0.3, 0.3) if centred else p.uniform_(0.7, 1.3)
            else:
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):     # Gemma 4's per-layer output scale: not 1
                b.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder)


def read_chunks(engine, seq, ids: list[int], sizes=()):
    """All logits of ids fed through the engine's runner in chunks of `sizes`, then the rest in one chunk: prompt
    chunks and one-token steps over the same cache -> [len(ids), vocab]."""
    import torch
    out, pos = [], 0
    for n in sizes:
        out.append(engine.runner.step([(seq, ids[pos:pos + n])], all_logits=True)[0])
        pos += n
    out.append(engine.runner.step([(seq, ids[pos:])], all_logits=True)[0])
    return torch.cat(out)
