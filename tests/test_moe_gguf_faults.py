"""Damaged mixture-of-experts GGUFs (issue 38 item 6): an expert count that disagrees with the tensors, a router of the
wrong shape, more experts used than there are, per-expert tensors that skip one: each a one-line ModelLoadError
naming the tensor or the key, before anything is packed. And Mixtral's older layout (one 2-D tensor per expert)
reads as the merged one: the same logits."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvchat.engine import CacheConfig, Engine, EngineConfig
from kvchat.engine.errors import ModelLoadError
from kvchat.engine.gguf.file import GGUFFile
from kvchat.engine.model.config import ModelConfig

H, HEADS, KV, D, E, USED, F, VOCAB, LAYERS = 64, 4, 2, 16, 4, 2, 64, 320, 2


def write_moe(path: Path, arch: str = "qwen3moe", *, experts: int = E, used: int = USED, router_rows: int = E,
              per_expert: bool = False, skip_expert: int | None = None, seed: int = 0) -> Path:
    """A tiny random F32 GGUF of a Qwen3-MoE (arch qwen3moe) or Mixtral (arch llama with an expert count) layer
    stack, written with gguf-py; the keys and tensors as llama.cpp's converter names them, the tokenizer the
    default model's."""
    from kvchat.bench.gguf_writer import _add_shape_keys, _copy_tokenizer, atomic_writer
    from kvchat.engine.model.source import default_gguf_path
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)
    with atomic_writer(path, arch) as wr:
        _add_shape_keys(wr, arch, layers=LAYERS, hidden=H, heads=HEADS, kv_heads=KV, ffn=F, head_dim=D,
                        context=2048, theta=10000.0, eps=1e-6, rotary_dims=D)
        wr.add_expert_count(experts)
        wr.add_expert_used_count(used)
        if arch == "qwen3moe":
            wr.add_expert_feed_forward_length(F)
        vocab = _copy_tokenizer(wr, default_gguf_path(), VOCAB)
        wr.add_tensor("token_embd.weight", w(vocab, H))
        wr.add_tensor("output_norm.weight", 1 + w(H))
        for i in range(LAYERS):
            p = f"blk.{i}."
            wr.add_tensor(p + "attn_norm.weight", 1 + w(H))
            wr.add_tensor(p + "attn_q.weight", w(HEADS * D, H))
            wr.add_tensor(p + "attn_k.weight", w(KV * D, H))
            wr.add_tensor(p + "attn_v.weight", w(KV * D, H))
            wr.add_tensor(p + "attn_output.weight", w(H, HEADS * D))
            if arch == "qwen3moe":
                wr.add_tensor(p + "attn_q_norm.weight", 1 + w(D))
                wr.add_tensor(p + "attn_k_norm.weight", 1 + w(D))
            wr.add_tensor(p + "ffn_norm.weight", 1 + w(H))
            wr.add_tensor(p + "ffn_gate_inp.weight", w(router_rows, H))
            stacks = {"ffn_gate": w(E, F, H), "ffn_up": w(E, F, H), "ffn_down": w(E, H, F)}
            for kind, t in stacks.items():
                if per_expert:
                    for e in range(E):
                        if e != skip_expert:
                            wr.add_tensor(f"{p}{kind}.{e}.weight", t[e])
                else:
                    wr.add_tensor(f"{p}{kind}_exps.weight", t)
        wr.write_header_to_file()
        wr.write_kv_data_to_file()
        wr.write_tensors_to_file()
    return path


def refused(path: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        ModelConfig.from_gguf(GGUFFile(path))
    text = str(info.value)
    assert "\n" not in text
    return text


def test_an_expert_count_that_disagrees_with_the_tensors_names_the_tensor(tmp_path):
    text = refused(write_moe(tmp_path / "m.gguf", experts=8))
    assert "blk.0.ffn_gate_inp.weight" in text or "ffn_gate_exps" in text
    assert "qwen3moe.expert_count" in text


def test_a_router_of_the_wrong_shape_names_it(tmp_path):
    text = refused(write_moe(tmp_path / "m.gguf", router_rows=E + 1))
    assert "blk.0.ffn_gate_inp.weight" in text and "[64, 5]" in text


def test_more_experts_used_than_there_are_names_the_keys(tmp_path):
    text = refused(write_moe(tmp_path / "m.gguf", used=E + 1))
    assert "qwen3moe.expert_used_count=5" in text and "qwen3moe.expert_count=4" in text


def test_per_expert_tensors_that_skip_one_are_refused(tmp_path):
    text = refused(write_moe(tmp_path / "m.gguf", "llama", per_expert=True, skip_expert=2))
    assert "blk.0.ffn_gate_exps.weight" in text or "skip an expert" in text


def test_mixtrals_older_per_expert_layout_reads_as_the_merged_one(tmp_path):
    """The same weights as 3-D tensors and as one tensor per expert: the same logits, bit for bit (F32 weights, so
    the engine runs the same dense linears either way), packed or dense."""
    merged = write_moe(tmp_path / "merged.gguf", "llama", seed=3)
    split = write_moe(tmp_path / "split.gguf", "llama", per_expert=True, seed=3)
    ids = list(range(10, 40))
    fp32 = CacheConfig(k_format="fp32", v_format="fp32")
    got = [Engine.load(EngineConfig(model=str(p))).new_session(cache=fp32).append(ids) for p in (merged, split)]
    assert torch.equal(got[0], got[1])
    config = ModelConfig.from_gguf(GGUFFile(split))
    assert config.model_type == "llama" and all(s.experts.count == E and s.experts.used == USED for s in config.layers)
