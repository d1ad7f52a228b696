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
