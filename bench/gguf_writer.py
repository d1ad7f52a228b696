"""Write GGUF files as llama.cpp's converter and quantizer would: random weights with real architectures' shapes
(benchmarks) or tiny ones (tests), and a Hugging Face folder's own weights (bench/gguf_hf.py: write_gguf_from_hf).

The files carry llama.cpp's metadata keys and tensor names for their architecture (llama, qwen3, gemma2, gemma3,
gemma4, phi3, smollm3, the mixtures of experts qwen3moe, gpt-oss and Mixtral's llama with an expert count, and
Qwen3.5's hybrids of Gated DeltaNet and gated attention qwen35 and qwen35moe: engine/model/gguf_arch.py names what
each stores), q/k rows permuted for llama.cpp's rotary layout where its converter permutes them (llama), Gemma 2 / 3's
and Qwen3.5's zero-centred norms stored as 1 + w as its converter stores them (Gemma 4's as w), experts as 3-D tensors
[experts, out, in] (or one 2-D tensor per expert, per_expert=True: Mixtral's older files, which kvchat still reads
and current llama.cpp no longer does), and a per-tensor type mix close to llama.cpp's defaults (bench/gguf_quant.py
quantizes). A random model's tokenizer (every `tokenizer.*` field, chat template included) is copied from the
default model's GGUF and padded with unused tokens to the preset's vocabulary (cut to it where the preset's is
smaller); a folder's byte-level BPE tokenizer is written as its own. llama.cpp and transformers load the results.

Past 450 lines on purpose: one table of presets and one writer per architecture family, read side by side.

    python -m kvchat.bench.gguf_writer --preset gpt-oss-20b --type MXFP4 --layers 4 [--out PATH]

--layers keeps the first N layers of a preset: benchmarks compare the per-token work of a layer, and a
mixture of experts' full file does not fit a small machine.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType, RopeScalingType
from gguf.constants import GGML_QUANT_SIZES

from kvchat.bench.gguf_quant import QK_K, quantize

CHUNK_ELEMENTS = 1 << 24          # rows are generated and quantized ~16M values (64 MiB of fp32) at a time


# ------------------------------------------------------------------------------------ shapes and mixes

@dataclass(frozen=True)
class ModelShape:
    """A model's shape as its GGUF stores it. arch: the GGUF architecture (llama, qwen3, gemma3, qwen3moe, gpt-oss);
    vocab: the real vocabulary, to which the copied default tokenizer is padded or cut (None: the tokenizer's own);
    window: the sliding window, on llama.cpp's pattern of the arch (Gemma 3: every sixth layer global; gpt-oss:
    the even layers slide). experts: routed experts per layer (0: a dense MLP), experts_used of them per token, each
    of intermediate size expert_ffn (None: intermediate). biases: q, k, v, o, router and expert biases; sinks:
    learned per-head sink logits; yarn: (factor, original context) of YaRN rope scaling (gpt-oss all three)."""
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    head_dim: int
    context: int = 8192
    rope_theta: float = 500000.0
    tied: bool = True
    arch: str = "llama"
    vocab: int | None = None
    window: int | None = None
    rms_norm_eps: float = 1e-5
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int | None = None
    biases: bool = False
    sinks: bool = False
    yarn: tuple[float, int] | None = None
    # Qwen3.5 (qwen35, qwen35moe): Gated DeltaNet layers of linear = (key heads, value heads, head width, conv kernel)
    # (llama.cpp reads one width for key and value heads: ssm.state_size), every full_every-th layer gated full
    # attention rotating `rotary` of head_dim; shared_ffn: the shared expert's intermediate size; mtp: the
    # multi-token-prediction blocks llama.cpp's converter appends after the layers
    linear: tuple[int, int, int, int] | None = None
    full_every: int = 0
    rotary: int | None = None
    shared_ffn: int = 0
    mtp: int = 0
    # Gemma 4 (gemma4): every full_every-th layer and the last full attention of global_head_dim heads, `rotary` of
    # its dimensions turned (proportional RoPE, rope_freqs), the others sliding over `window` with head_dim heads at
    # rope_theta_swa; the last shared_kv layers reuse the KV of the last earlier layer of their kind; ple: the
    # per-layer embedding width; global_kv_heads: the full layers' KV heads where their keys are their values (no
    # attn_v; None: kv_heads and values of their own); softcap: the final logit soft-cap
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    ple: int = 0
    shared_kv: int = 0
    rope_theta_swa: float | None = None
    softcap: float | None = None

    def __post_init__(self):
        if self.experts and not 0 < self.experts_used <= self.experts:
            raise ValueError(f"{self.name}: {self.experts_used} experts used of {self.experts}")
        if self.arch == "llama" and self.experts and self.expert_ffn not in (None, self.intermediate):
            raise ValueError(f"{self.name}: llama.cpp reads a llama file's experts at feed_forward_length "
                             f"({self.intermediate}), not {self.expert_ffn}")
        if self.arch in _ROUTED and not self.experts:
            raise ValueError(f"{self.name}: llama.cpp reads every {self.arch} layer as a mixture of experts")
        if (self.arch in _HYBRID) != (self.linear is not None and self.full_every > 0):
            raise ValueError(f"{self.name}: linear-attention layers (linear, full_every) are for arch qwen35 / "
                             f"qwen35moe, and those need them")
        if self.linear and self.linear[1] % self.linear[0]:
            raise ValueError(f"{self.name}: {self.linear[1]} value heads are not a multiple of {self.linear[0]} key "
                             f"heads")
        if self.arch == "gemma4":
            if not (self.global_head_dim and self.full_every and self.window and self.rotary):
                raise ValueError(f"{self.name}: a random gemma4 has global_head_dim, full_every, window and rotary")
            if self.experts and not self.expert_ffn:
                raise ValueError(f"{self.name}: Gemma 4's experts beside the dense MLP need their own expert_ffn")
            types, first = self.layer_types, self.layers - self.shared_kv
            # llama.cpp's shared layers read layer first - 1 (full) or first - 2 (sliding)
            sliding_shared = "sliding_attention" in types[first:]
            if self.shared_kv and (types[first - 1] != "full_attention"
                                   or (sliding_shared and types[first - 2] != "sliding_attention")):
                raise ValueError(f"{self.name}: {self.shared_kv} KV-shared layers of {self.layers} do not start "
                                 f"after a sliding then a full layer, as llama.cpp's gemma4 reads them")

    @property
    def blocks(self) -> int:
        """block_count: the layers and the MTP blocks after them."""
        return self.layers + self.mtp

    def is_linear(self, layer: int) -> bool:
        """A Gated DeltaNet layer (llama.cpp's qwen35 pattern: every full_every-th layer full attention)."""
        return bool(self.linear) and layer < self.layers and (layer + 1) % self.full_every != 0

    @property
    def ffn_exp(self) -> int:
        return self.expert_ffn or self.intermediate

    @property
    def layer_types(self) -> list[str]:
        """Gemma 4's layers: every full_every-th and the last full attention, the others sliding."""
        return ["full_attention" if (i + 1) % self.full_every == 0 or i == self.layers - 1 else "sliding_attention"
                for i in range(self.layers)]


def cut_layers(shape: ModelShape, layers: int) -> ModelShape:
    """shape's first `layers` layers. A Gemma 4 keeps its layer pattern (the last layer full) and its KV-shared tail
    about as large a part of the layers, starting after a full layer as llama.cpp reads it, with one shared layer of
    each kind at least (8 layers at least)."""
    if not 0 < layers <= shape.layers:
        raise ValueError(f"layers={layers}: {shape.name} has {shape.layers} layers, keep 1 to {shape.layers}")
    if shape.arch != "gemma4" or not shape.shared_kv or layers == shape.layers:
        return replace(shape, layers=layers)
    cut = replace(shape, layers=layers, shared_kv=0)
    types = cut.layer_types
    starts = [i + 1 for i in range(layers - 2) if types[i] == "full_attention"]       # a sliding one shared too
    if not starts:
        raise ValueError(f"layers={layers}: {shape.name} cut keeps no KV-shared sliding and full layer; keep "
                         f"{2 * shape.full_every - 4} layers at least")
    target = layers - round(layers * shape.shared_kv / shape.layers)
    return replace(cut, shared_kv=layers - min(starts, key=lambda f: abs(f - target)))


# architectures whose every layer llama.cpp reads as routed (llama has experts where its expert_count says)
_ROUTED = {"qwen3moe", "gpt-oss", "qwen35moe"}
# hybrids of Gated DeltaNet and full attention
_HYBRID = {"qwen35", "qwen35moe"}
# the rotary sections llama.cpp's converter writes for Qwen3.5 (transformers' default mrope_section, padded to 4);
# on text every section turns at the token's position, so they rotate as one plain NeoX rope
QWEN35_ROPE_SECTIONS = (11, 11, 10, 0)

PRESETS = {
    "tiny": ModelShape("tiny", 2, 256, 4, 2, 512, 64, 2048, 10000.0, True),
    "smollm2-135m": ModelShape("smollm2-135m", 30, 576, 9, 3, 1536, 64, 8192, 100000.0, True),   # the default's shape
    "llama-3.2-1b": ModelShape("llama-3.2-1b", 16, 2048, 32, 8, 8192, 64, 8192, 500000.0, True),
    "llama-3.2-3b": ModelShape("llama-3.2-3b", 28, 3072, 24, 8, 8192, 128, 8192, 500000.0, True),
    "qwen3-0.6b": ModelShape("qwen3-0.6b", 28, 1024, 16, 8, 3072, 128, 40960, 1e6, True, arch="qwen3",
                             vocab=151936, rms_norm_eps=1e-6),
    "gemma-3-1b": ModelShape("gemma-3-1b", 26, 1152, 4, 1, 6912, 256, 32768, 1e6, True, arch="gemma3",
                             vocab=262144, window=512, rms_norm_eps=1e-6),
    # google/gemma-2-2b: 26 layers of 2304, 8 / 4 heads of 256, every other layer sliding over 4,096, scores capped
    # at 50 and logits at 30 (written as llama.cpp's converter writes them)
    "gemma-2-2b": ModelShape("gemma-2-2b", 26, 2304, 8, 4, 9216, 256, 8192, 10000.0, True, arch="gemma2",
                             vocab=256000, window=4096, rms_norm_eps=1e-6),
    # microsoft/Phi-4-mini-instruct's config.json: 32 layers of 3072, 24 / 8 heads of 128, three quarters rotated
    # (partial_rotary_factor 0.75), intermediate 8192, vocabulary 200,064, tied; written at its original context of
    # 4,096 without the LongRoPE factors (they change the angles, not the work a token costs)
    "phi-4-mini": ModelShape("phi-4-mini", 32, 3072, 24, 8, 8192, 128, 4096, 10000.0, True, arch="phi3",
                             vocab=200064, rotary=96),
    # mixtures of experts, as each Hugging Face repository's config.json gives them (engine/plan/presets.py
    # holds the same fields). Qwen/Qwen3-30B-A3B: 128 experts of 768, 8 used, renormalized (norm_topk_prob);
    # intermediate_size 6144 is the unused dense size the converter still writes as feed_forward_length
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", 48, 2048, 32, 4, 6144, 128, 40960, 1e6, False, arch="qwen3moe",
                                vocab=151936, rms_norm_eps=1e-6, experts=128, experts_used=8, expert_ffn=768),
    # openai/gpt-oss-20b: 32 experts of 2880, 4 used; even layers over a window of 128; YaRN x32 over 4,096
    "gpt-oss-20b": ModelShape("gpt-oss-20b", 24, 2880, 64, 8, 2880, 64, 131072, 150000.0, False, arch="gpt-oss",
                              vocab=201088, window=128, rms_norm_eps=1e-5, experts=32, experts_used=4,
                              expert_ffn=2880, biases=True, sinks=True, yarn=(32.0, 4096)),
    # mistralai/Mixtral-8x7B-v0.1 (and -Instruct-v0.1): written by llama.cpp as arch llama with an expert count
    "mixtral-8x7b": ModelShape("mixtral-8x7b", 32, 4096, 32, 8, 14336, 128, 32768, 1e6, False, vocab=32000,
                               experts=8, experts_used=2),
    # Qwen/Qwen3.5-9B and Qwen/Qwen3.5-35B-A3B: the text_config of each repository's config.json (the layer, head
    # and linear-attention numbers are also transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig defaults; the 9B's
    # as llama.cpp prints its GGUF: 8.95B parameters, untied). 3 Gated DeltaNet layers (16 key heads, 32 value heads,
    # all 128 wide, conv kernel 4) then one gated attention layer (head_dim 256, a quarter rotated:
    # partial_rotary_factor 0.25), rope_theta 1e7, 262,144 positions, vocabulary 248,320; one MTP block
    # (mtp_num_hidden_layers 1), which llama.cpp's converter writes after the layers. The 9B: 32 layers of 4096,
    # 16 / 4 heads, intermediate 12288. The 35B-A3B: 40 layers of 2048, 16 / 2 heads, 256 experts of 512 (8 used)
    # and a shared expert of 512; its config has no dense intermediate_size (no feed_forward_length is written; the
    # 512 here sizes nothing)
    "qwen3.5-9b": ModelShape("qwen3.5-9b", 32, 4096, 16, 4, 12288, 256, 262144, 1e7, False, arch="qwen35",
                             vocab=248320, rms_norm_eps=1e-6, linear=(16, 32, 128, 4), full_every=4, rotary=64, mtp=1),
    "qwen3.5-35b-a3b": ModelShape("qwen3.5-35b-a3b", 40, 2048, 16, 2, 512, 256, 262144, 1e7, False, arch="qwen35moe",
                                  vocab=248320, rms_norm_eps=1e-6, experts=256, experts_used=8, expert_ffn=512,
                                  linear=(16, 32, 128, 4), full_every=4, rotary=64, shared_ffn=512, mtp=1),
    # google/gemma-4-E4B (its config.json's text_config; transformers' Gemma4TextConfig): 42 layers of 2560, 8 / 2
    # heads, intermediate 10240, five sliding layers (head_dim 256, window 512, rope_theta 1e4) then a full one
    # (global_head_dim 512, proportional RoPE over a quarter: partial_rotary_factor 0.25, rope_theta 1e6), keys and
    # values of their own (attention_k_eq_v false, no num_global_key_value_heads), the last 18 layers on earlier KV
    # (num_kv_shared_layers), per-layer embeddings of 256 (hidden_size_per_layer_input; vocab_size_per_layer_input
    # 262,144), vocabulary 262,144, 131,072 positions, final soft-cap 30, tied
    "gemma-4-e4b": ModelShape("gemma-4-e4b", 42, 2560, 8, 2, 10240, 256, 131072, 1e6, True, arch="gemma4",
                              vocab=262144, window=512, rms_norm_eps=1e-6, full_every=6, rotary=128,
                              global_head_dim=512, ple=256, shared_kv=18, rope_theta_swa=10000.0, softcap=30.0),
    # google/gemma-4-26B-A4B (its text_config): 30 layers of 2816, 16 heads, 8 KV heads of 256 in the sliding layers
    # (window 1,024) and 2 of 512 in the full ones, whose keys are their values (attention_k_eq_v), no KV-shared
    # layers and no per-layer embeddings; every layer a dense MLP of 2,112 beside 128 experts of 704 (8 used)
    "gemma-4-26b-a4b": ModelShape("gemma-4-26b-a4b", 30, 2816, 16, 8, 2112, 256, 262144, 1e6, True, arch="gemma4",
                                  vocab=262144, window=1024, rms_norm_eps=1e-6, full_every=6, rotary=128,
                                  global_head_dim=512, global_kv_heads=2, rope_theta_swa=10000.0, softcap=30.0,
                                  experts=128, experts_used=8, expert_ffn=704),
}

# mix name -> (type of the 2-D layer weights, token_embd / output type, general.file_type)
MIXES: dict[str, tuple[str, str, LlamaFileType]] = {
    "Q4_0": ("Q4_0", "Q8_0", LlamaFileType.MOSTLY_Q4_0),
    "Q4_1": ("Q4_1", "Q8_0", LlamaFileType.MOSTLY_Q4_1),
    "Q5_0": ("Q5_0", "Q8_0", LlamaFileType.MOSTLY_Q5_0),
    "Q5_1": ("Q5_1", "Q8_0", LlamaFileType.MOSTLY_Q5_1),
    "Q4_K_M": ("Q4_K", "Q6_K", LlamaFileType.MOSTLY_Q4_K_M),   # + Q6_K attn_v / ffn_down: see tensor_type
    "Q8_0": ("Q8_0", "Q8_0", LlamaFileType.MOSTLY_Q8_0),
    "Q4_K": ("Q4_K", "Q4_K", LlamaFileType.MOSTLY_Q4_K_S),
    "Q6_K": ("Q6_K", "Q6_K", LlamaFileType.MOSTLY_Q6_K),
    # llama.cpp's MXFP4_MOE (ggml-org's gpt-oss GGUFs): 3-D expert tensors MXFP4, every other matrix Q8_0
    "MXFP4": ("Q8_0", "Q8_0", LlamaFileType.MOSTLY_MXFP4_MOE),
    "F16": ("F16", "F16", LlamaFileType.MOSTLY_F16),
    "BF16": ("BF16", "BF16", LlamaFileType.MOSTLY_BF16),
    "F32": ("F32", "F32", LlamaFileType.ALL_F32),
}
# llama.cpp's quantizer's type for rows that are not whole 256-value super-blocks (Gemma 3 1B's hidden 1152)
_SHORT_ROW_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_FLOAT_MIXES = {"F16", "BF16", "F32"}


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the Q4_K_M layers whose attn_v and ffn_down get Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(mix: str, name: str, layers: int, tied: bool, experts: int = 0, stacked: bool = False) -> str:
    """The type llama.cpp's quantizer (llama_tensor_get_type) would give tensor `name` (GGUF name) in this mix.

    F32 where llama.cpp never quantizes: norms, biases and anything else not named .weight (Qwen3.5's ssm_a), sink
    logits, the router (ffn_gate_inp), the shared expert's gate (one row: llama.cpp quantizes 2-D tensors only) and
    a Gated DeltaNet's conv1d. Q4_K_M follows llama.cpp: output (and token_embd when tied to it) Q6_K, untied
    token_embd Q4_K, attn_v and the fused attn_qkv (llama.cpp's attn_v-like ones: Qwen3.5's linear layers, Phi-3)
    and ffn_down (the experts' and the shared expert's too) Q6_K in the use_more_bits layers (counted over every
    block, MTP blocks included), Q4_K elsewhere. A model of exactly 8 experts (Mixtral) gets attn_k and attn_v in
    Q8_0 in every quantized mix and attn_output Q5_K in the K mixes. MXFP4: stacked (3-D) expert tensors MXFP4,
    every other matrix Q8_0.
    """
    if mix not in MIXES:
        raise ValueError(f"unknown type {mix!r}: one of {', '.join(MIXES)}")
    base, edge, _ = MIXES[mix]
    if (not name.endswith(".weight") or name.endswith("_norm.weight")
            or name.endswith((".ffn_gate_inp.weight", ".attn_sinks.weight", ".ffn_gate_inp_shexp.weight",
                              ".ssm_conv1d.weight"))):
        return "F32"
    if name == "output.weight" or (name == "token_embd.weight" and tied):
        return edge
    if mix == "MXFP4":
        return "MXFP4" if stacked else base
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):     # Gemma 4's PLE table: token_embd's rule
        return base if mix == "Q4_K_M" else edge
    if mix in _FLOAT_MIXES:
        return base
    if experts == 8 and name.endswith((".attn_k.weight", ".attn_v.weight", ".attn_qkv.weight")):
        return "Q8_0"
    if experts == 8 and mix in ("Q4_K_M", "Q4_K") and name.endswith(".attn_output.weight"):
        return "Q5_K"
    if mix == "Q4_K_M" and (name.endswith((".attn_v.weight", ".attn_qkv.weight")) or ".ffn_down" in name):
        return "Q6_K" if use_more_bits(int(name.split(".")[1]), layers) else base
    return base


def file_type(mix: str, name: str, numpy_shape: tuple[int, ...], layers: int, tied: bool, experts: int = 0) -> str:
    """tensor_type, with llama.cpp's rules for what it cannot hold: 1-D tensors (norms, biases, rope factors)
    F32, a K-quant of rows that are not whole super-blocks its fallback type."""
    if len(numpy_shape) == 1:
        return "F32"
    kind = tensor_type(mix, name, layers, tied, experts, stacked=len(numpy_shape) == 3)
    if kind in _SHORT_ROW_FALLBACK and numpy_shape[-1] % QK_K:
        kind = _SHORT_ROW_FALLBACK[kind]
    block = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0]
    return kind if numpy_shape[-1] % block == 0 else "F32"


# a layer's extra tensors beyond the Llama ones, per GGUF architecture: qk: q / k norms, post: Gemma's post-norms
_QK_NORMS = {"qwen3", "gemma3", "qwen3moe"}
_POST_NORMS = {"gemma2", "gemma3"}
# the norm before the MLP, where llama.cpp names it other than ffn_norm
_MLP_NORM = {"gpt-oss": "post_attention_norm"}


def _tensors(shape: ModelShape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape: [out, in], an expert stack [experts, out, in]) in the order llama.cpp's converter
    writes them."""
    if shape.arch in _HYBRID:
        return _hybrid_tensors(shape, vocab)
    if shape.arch == "gemma4":
        return _gemma4_tensors(shape, vocab)
    h, q, kv, f = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    if shape.arch == "phi3":            # Phi-3's fused q|k|v and gate|up, as llama.cpp's converter writes them
        out = [("token_embd.weight", (vocab, h))]
        for i in range(shape.layers):
            p = f"blk.{i}."
            out += [(p + "attn_norm.weight", (h,)), (p + "attn_qkv.weight", (q + 2 * kv, h)),
                    (p + "attn_output.weight", (h, q)), (p + "ffn_norm.weight", (h,)),
                    (p + "ffn_up.weight", (2 * f, h)), (p + "ffn_down.weight", (h, f))]
        out.append(("output_norm.weight", (h,)))
        return out + ([] if shape.tied else [("output.weight", (vocab, h))])
    e, fe = shape.experts, shape.ffn_exp
    out = [("token_embd.weight", (vocab, h))]
    for i in range(shape.layers):
        p = f"blk.{i}."
        out.append((p + "attn_norm.weight", (h,)))
        for name, rows, cols in (("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h), ("attn_output", h, q)):
            out.append((p + name + ".weight", (rows, cols)))
            if shape.biases:
                out.append((p + name + ".bias", (rows,)))
        if shape.arch in _QK_NORMS:
            out += [(p + "attn_q_norm.weight", (shape.head_dim,)), (p + "attn_k_norm.weight", (shape.head_dim,))]
        if shape.sinks:
            out.append((p + "attn_sinks.weight", (shape.heads,)))
        if shape.arch in _POST_NORMS:
            out.append((p + "post_attention_norm.weight", (h,)))
        out.append((p + _MLP_NORM.get(shape.arch, "ffn_norm") + ".weight", (h,)))
        if e:
            out.append((p + "ffn_gate_inp.weight", (e, h)))
            if shape.biases:
                out.append((p + "ffn_gate_inp.bias", (e,)))
            for kind, rows, cols in (("ffn_gate", fe, h), ("ffn_up", fe, h), ("ffn_down", h, fe)):
                out.append((f"{p}{kind}_exps.weight", (e, rows, cols)))
                if shape.biases:
                    out.append((f"{p}{kind}_exps.bias", (e, rows)))
        else:
            out += [(p + "ffn_gate.weight", (f, h)), (p + "ffn_up.weight", (f, h)), (p + "ffn_down.weight", (h, f))]
        if shape.arch in _POST_NORMS:
            out.append((p + "post_ffw_norm.weight", (h,)))
    out.append(("output_norm.weight", (h,)))
    if not shape.tied:
        out.append(("output.weight", (vocab, h)))
    return out


def _hybrid_tensors(shape: ModelShape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen3.5's tensors (llama.cpp's qwen35 / qwen35moe): per layer a Gated DeltaNet (the fused q|k|v projection
    attn_qkv, its output gate attn_gate, beta and alpha rows, the depthwise conv [channels, kernel], dt bias, the
    bare decay ssm_a, the gated norm of one head's width, ssm_out) or gated attention (attn_q: each head's query and
    gate rows), the MLP's pre-norm post_attention_norm, a dense MLP or the experts with a shared expert; then the MTP
    blocks: gated attention and the MLP, with the nextn projection [hidden, 2 x hidden] and its norms."""
    h, d, f = shape.hidden, shape.head_dim, shape.intermediate
    hk, hv, width, kernel = shape.linear
    channels, values = 2 * hk * width + hv * width, hv * width
    out = [("token_embd.weight", (vocab, h))]
    for i in range(shape.blocks):
        p = f"blk.{i}."
        out.append((p + "attn_norm.weight", (h,)))
        if shape.is_linear(i):
            out += [(p + "attn_qkv.weight", (channels, h)), (p + "attn_gate.weight", (values, h)),
                    (p + "ssm_beta.weight", (hv, h)), (p + "ssm_alpha.weight", (hv, h)),
                    (p + "ssm_conv1d.weight", (channels, kernel)), (p + "ssm_dt.bias", (hv,)), (p + "ssm_a", (hv,)),
                    (p + "ssm_norm.weight", (width,)), (p + "ssm_out.weight", (h, values))]
        else:
            out += [(p + "attn_q.weight", (2 * shape.heads * d, h)), (p + "attn_k.weight", (shape.kv_heads * d, h)),
                    (p + "attn_v.weight", (shape.kv_heads * d, h)), (p + "attn_output.weight", (h, shape.heads * d)),
                    (p + "attn_q_norm.weight", (d,)), (p + "attn_k_norm.weight", (d,))]
        out.append((p + "post_attention_norm.weight", (h,)))
        if shape.experts:
            e, fe, fs = shape.experts, shape.ffn_exp, shape.shared_ffn
            out += [(p + "ffn_gate_inp.weight", (e, h)), (p + "ffn_gate_exps.weight", (e, fe, h)),
                    (p + "ffn_up_exps.weight", (e, fe, h)), (p + "ffn_down_exps.weight", (e, h, fe)),
                    (p + "ffn_gate_inp_shexp.weight", (1, h)), (p + "ffn_gate_shexp.weight", (fs, h)),
                    (p + "ffn_up_shexp.weight", (fs, h)), (p + "ffn_down_shexp.weight", (h, fs))]
        else:
            out += [(p + "ffn_gate.weight", (f, h)), (p + "ffn_up.weight", (f, h)), (p + "ffn_down.weight", (h, f))]
        if i >= shape.layers:
            out += [(p + "nextn.eh_proj.weight", (h, 2 * h)), (p + "nextn.enorm.weight", (h,)),
                    (p + "nextn.hnorm.weight", (h,)), (p + "nextn.shared_head_norm.weight", (h,))]
    out.append(("output_norm.weight", (h,)))
    if not shape.tied:
        out.append(("output.weight", (vocab, h)))
    return out


def _gemma4_tensors(shape: ModelShape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """Gemma 4's tensors (llama.cpp's gemma4; gguf_arch.GEMMA4_*): the per-layer embedding table, its projection and
    norm, the full layers' rope_freqs; per layer attention of the layer's head width (no k / v / k-norm in a
    KV-shared layer, no v where keys are values), the MLP between its four norms, the per-layer input gate,
    projection and norm, and the layer's output scale."""
    h, f, p, n = shape.hidden, shape.intermediate, shape.ple, shape.layers
    out = [("token_embd.weight", (vocab, h))]
    if p:
        out += [("per_layer_token_embd.weight", (vocab, n * p)), ("per_layer_model_proj.weight", (n * p, h)),
                ("per_layer_proj_norm.weight", (p,))]
    out.append(("rope_freqs.weight", (shape.global_head_dim // 2,)))
    for i, kind in enumerate(shape.layer_types):
        full, own, b = kind == "full_attention", i < n - shape.shared_kv, f"blk.{i}."
        d = shape.global_head_dim if full else shape.head_dim
        kv = (shape.global_kv_heads or shape.kv_heads) if full else shape.kv_heads
        out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (shape.heads * d, h))]
        if own:
            out.append((b + "attn_k.weight", (kv * d, h)))
            if not (full and shape.global_kv_heads):
                out.append((b + "attn_v.weight", (kv * d, h)))
        out += [(b + "attn_output.weight", (h, shape.heads * d)), (b + "attn_q_norm.weight", (d,))]
        if own:
            out.append((b + "attn_k_norm.weight", (d,)))
        out += [(b + "post_attention_norm.weight", (h,)), (b + "ffn_norm.weight", (h,)),
                (b + "ffn_gate.weight", (f, h)), (b + "ffn_up.weight", (f, h)), (b + "ffn_down.weight", (h, f)),
                (b + "post_ffw_norm.weight", (h,))]
        if shape.experts:       # the 26B-A4B's routed experts beside the dense MLP, with their three norms
            e, fe = shape.experts, shape.expert_ffn
            out += [(b + "ffn_gate_inp.weight", (e, h)), (b + "ffn_gate_inp.scale", (h,)),
                    (b + "ffn_gate_up_exps.weight", (e, 2 * fe, h)), (b + "ffn_down_exps.weight", (e, h, fe)),
                    (b + "ffn_down_exps.scale", (e,)), (b + "pre_ffw_norm_2.weight", (h,)),
                    (b + "post_ffw_norm_1.weight", (h,)), (b + "post_ffw_norm_2.weight", (h,))]
        if p:
            out += [(b + "inp_gate.weight", (p, h)), (b + "proj.weight", (h, p)), (b + "post_norm.weight", (h,))]
        out.append((b + "layer_output_scale.weight", (1,)))
    out.append(("output_norm.weight", (h,)))
    if not shape.tied:
        out.append(("output.weight", (vocab, h)))
    return out


def gemma4_rope_freqs(shape: ModelShape) -> np.ndarray:
    """The converter's rope_freqs: 1 for the full layers' `rotary` / 2 turned pairs, 1e30 (no turn) for the rest."""
    from kvchat.engine.model.gguf_arch import GEMMA4_UNROTATED
    half = shape.global_head_dim // 2
    return np.array([1.0] * (shape.rotary // 2) + [GEMMA4_UNROTATED] * (half - shape.rotary // 2), np.float32)


def _add_gemma4_keys(writer: GGUFWriter, shape: ModelShape) -> None:
    """Gemma 4's keys beyond _add_shape_keys' (whose key_length and rope.dimension_count are the full layers')."""
    types = shape.layer_types
    writer.add_rope_freq_base_swa(shape.rope_theta_swa or shape.rope_theta)
    writer.add_key_length_swa(shape.head_dim)
    writer.add_value_length_swa(shape.head_dim)
    if shape.softcap:
        writer.add_final_logit_softcapping(shape.softcap)
    writer.add_shared_kv_layers(shape.shared_kv)
    writer.add_embedding_length_per_layer_input(shape.ple)
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    writer.add_rope_dimension_count_swa(shape.head_dim)


def split_experts(name: str, numpy_shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """Mixtral's older layout of one 3-D expert weight: (blk.N.<kind>.<e>.weight, [out, in]) per expert."""
    p, kind, _ = name.rsplit(".", 2)
    return [(f"{p}.{kind.removesuffix('_exps')}.{x}.weight", numpy_shape[1:]) for x in range(numpy_shape[0])]


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's permute of q / k rows (Hugging Face order -> GGUF rotary layout)."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _nbytes(numpy_shape: tuple[int, ...], type_name: str) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    *outer, cols = numpy_shape
    return int(np.prod(outer, dtype=np.int64)) * (cols // block) * size


def _weights(name: str, numpy_shape: tuple[int, ...], type_name: str, rng: np.random.Generator,
             shape: ModelShape) -> np.ndarray:
    """One tensor's random weights in its file type: norms around 1, biases and sink logits small, matrices a chunk
    of rows at a time (q / k whole, to permute them); a stacked expert tensor [experts, out, in] one expert at a
    time, so no more than one expert's chunk of fp32 values is ever held."""
    if len(numpy_shape) == 1 and name.endswith("norm.weight"):
        return rng.uniform(0.9, 1.1, numpy_shape).astype(np.float32)
    if name == "rope_freqs.weight":
        return gemma4_rope_freqs(shape)
    if name.endswith((".layer_output_scale.weight", ".ffn_gate_inp.scale", ".ffn_down_exps.scale")):
        return rng.uniform(0.5, 1.0, numpy_shape).astype(np.float32)
    if name.endswith(".ssm_a"):          # a decay rate A = -exp(A_log): negative, as transformers initializes it
        return -rng.uniform(0.01, 16.0, numpy_shape).astype(np.float32)
    if len(numpy_shape) == 1 or not name.endswith(".weight"):
        return (rng.standard_normal(numpy_shape, dtype=np.float32) * np.float32(0.02)).astype(np.float32)
    if len(numpy_shape) == 3:
        first = _matrix(name, numpy_shape[1:], type_name, rng, shape)
        out = np.empty((numpy_shape[0], *first.shape), dtype=first.dtype)
        out[0] = first
        for e in range(1, numpy_shape[0]):
            out[e] = _matrix(name, numpy_shape[1:], type_name, rng, shape)
        return out
    return _matrix(name, numpy_shape, type_name, rng, shape)


def _matrix(name: str, numpy_shape: tuple[int, ...], type_name: str, rng: np.random.Generator,
            shape: ModelShape) -> np.ndarray:
    rows, cols = numpy_shape
    if shape.arch == "llama" and name.endswith((".attn_q.weight", ".attn_k.weight")):
        w = rng.standard_normal(numpy_shape, dtype=np.float32)
        w *= np.float32(0.02)
        w = permute(w, shape.heads if name.endswith(".attn_q.weight") else shape.kv_heads)
        return quantize(w, type_name)
    step = max(1, CHUNK_ELEMENTS // cols)
    out = None
    for start in range(0, rows, step):
        w = rng.standard_normal((min(step, rows - start), cols), dtype=np.float32)
        w *= np.float32(0.02)
        part = quantize(w, type_name)
        del w
        if out is None:
            out = np.empty((rows, part.shape[1]), dtype=part.dtype)
        out[start:start + len(part)] = part
    return out


# ------------------------------------------------------------------------------------------- writing

@functools.lru_cache(maxsize=4)
def _tokenizer_fields(source: str, mtime_ns: int) -> tuple[tuple[str, object, GGUFValueType, GGUFValueType | None], ...]:
    """Every tokenizer.* field of a GGUF as (key, value, type, array item type); parsed once per process."""
    reader = GGUFReader(source)          # seconds for a 49k-token vocabulary: hence the cache
    out = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = GGUFValueType(field.types[0])
        if vtype == GGUFValueType.ARRAY and len(field.types) != 2:
            raise ValueError(f"{source}: nested array {key} is not supported")
        sub = GGUFValueType(field.types[1]) if vtype == GGUFValueType.ARRAY else None
        out.append((key, field.contents(), vtype, sub))
    return tuple(out)


def _copy_tokenizer(writer: GGUFWriter, source: Path, vocab: int | None = None, cut: bool = False) -> int:
    """Copy every tokenizer.* field of `source` into writer, the vocabulary padded with unused tokens
    (`<unused{n}>`, type UNUSED, score 0) to `vocab` entries when it is larger; where it is smaller and `cut`, the
    first `vocab` tokens kept with the merges among them (a merge of kept parts into a kept token). Return the
    vocabulary size."""
    fields = _tokenizer_fields(str(source), source.stat().st_mtime_ns)
    tokens = next((value for key, value, _, _ in fields if key == "tokenizer.ggml.tokens"), None)
    if not tokens:
        raise ValueError(f"{source} has no tokenizer.ggml.tokens")
    if cut and vocab and vocab < len(tokens):
        return _copy_cut_tokenizer(writer, source, fields, vocab)
    pad = max(0, (vocab or 0) - len(tokens))
    padding = {"tokenizer.ggml.tokens": [f"<unused{n}>" for n in range(pad)],
               "tokenizer.ggml.token_type": [5] * pad, "tokenizer.ggml.scores": [0.0] * pad}
    for key, value, vtype, sub in fields:
        if pad and key in padding:
            value = list(value) + padding[key]
        writer.add_key_value(key, value, vtype, sub)
    return len(tokens) + pad


def _copy_cut_tokenizer(writer: GGUFWriter, source: Path, fields, vocab: int) -> int:
    tokens = next(value for key, value, _, _ in fields if key == "tokenizer.ggml.tokens")
    kept = set(tokens[:vocab])
    for key, value, vtype, sub in fields:
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            value = list(value[:vocab])
        elif key == "tokenizer.ggml.merges":
            value = [m for m in value
                     if m.replace(" ", "", 1) in kept and all(part in kept for part in m.split(" ", 1))]
        elif key.endswith("_token_id") and int(value) >= vocab:
            raise ValueError(f"{source}: {key} {value} is past a vocabulary of {vocab} tokens")
        writer.add_key_value(key, value, vtype, sub)
    return vocab


def _add_shape_keys(writer: GGUFWriter, arch: str, *, layers: int, hidden: int, heads: int, kv_heads: int,
                    ffn: int | None, head_dim: int, context: int, theta: float, eps: float, rotary_dims: int) -> None:
    """The keys every architecture here stores, in the order llama.cpp's converter writes them (feed_forward_length
    only where the model has a dense intermediate size: ffn None, as Qwen3.5-MoE's config has none)."""
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    if ffn is not None:
        writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_rope_dimension_count(rotary_dims)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)


@contextlib.contextmanager
def atomic_writer(path: Path, arch: str):
    """A GGUFWriter whose file appears at `path` complete or not at all (temporary name, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    writer = GGUFWriter(tmp, arch)
    try:
        yield writer
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise


def write_vocab_gguf(path: str | os.PathLike, source: str | os.PathLike | None = None) -> Path:
    """A GGUF with the default model's tokenizer (every tokenizer.* field) and no tensors: a few MB that let
    write_random_gguf run where the default model is not installed (KVCHAT_VOCAB_GGUF)."""
    if source is None:
        from kvchat.engine.model.source import default_gguf_path
        source = default_gguf_path()
    path = Path(path)
    with atomic_writer(path, "llama") as writer:
        writer.add_name("kvchat tokenizer only")
        _copy_tokenizer(writer, Path(source))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
    return path


def write_random_gguf(path: str | os.PathLike, shape: ModelShape | str, qtype: str, seed: int = 0,
                      vocab_from: str | os.PathLike | None = None, layers: int | None = None,
                      per_expert: bool = False, weights: bool = True) -> Path:
    """Write a random-weight GGUF of `shape` (its arch) in mix `qtype` to `path` and return the path.

    layers: keep only the first `layers` layers of the shape (a Qwen3.5's MTP blocks stay after them). per_expert:
    experts as one 2-D tensor each (blk.N.ffn_gate.E.weight), as Mixtral's older files store them (kvchat reads
    them; llama.cpp no longer does); only arch llama (Mixtral) has that layout. The experts of both layouts hold the
    same values for one seed. weights=False: every tensor's bytes left zero, as a sparse file (no time, no disk
    space): the header, shapes and types of a model too large to write, for a reader or planner to check.
    The file appears complete or not at all (written under a temporary name, then renamed). At most one
    tensor's quantized bytes and one chunk of fp32 values are held at a time.
    """
    if isinstance(shape, str):
        shape = preset(shape)
    if layers is not None:
        shape = cut_layers(shape, layers)
    if qtype not in MIXES:
        raise ValueError(f"unknown type {qtype!r}: one of {', '.join(MIXES)}")
    if per_expert and not (shape.experts and shape.arch == "llama"):
        raise ValueError(f"{shape.name}: one tensor per expert is Mixtral's older layout (arch llama with experts); "
                         f"llama.cpp reads {shape.arch} experts only as 3-D tensors")
    if vocab_from is None:       # KVCHAT_VOCAB_GGUF: a GGUF holding the tokenizer, where the default model is not
        from kvchat.engine.model.source import default_gguf_path        # installed (packaging/gpu_check.sh carries one)
        vocab_from = os.environ.get("KVCHAT_VOCAB_GGUF") or default_gguf_path()
    path = Path(path)
    with atomic_writer(path, shape.arch) as writer:
        writer.add_name(f"random {shape.name} {qtype}")
        gemma4 = shape.arch == "gemma4"
        kv_heads = ([shape.kv_heads if t == "sliding_attention" else shape.global_kv_heads for t in shape.layer_types]
                    if gemma4 and shape.global_kv_heads else shape.kv_heads)
        head_dim = shape.global_head_dim if gemma4 else shape.head_dim
        _add_shape_keys(writer, shape.arch, layers=shape.blocks, hidden=shape.hidden, heads=shape.heads,
                        kv_heads=kv_heads, ffn=None if shape.arch == "qwen35moe" else shape.intermediate,
                        head_dim=head_dim, context=shape.context, theta=shape.rope_theta,
                        eps=shape.rms_norm_eps, rotary_dims=head_dim if gemma4 else shape.rotary or shape.head_dim)
        if gemma4:
            _add_gemma4_keys(writer, shape)
        _add_moe_keys(writer, shape.arch, shape.experts, shape.experts_used, shape.ffn_exp)
        if shape.linear:
            hk, hv, width, kernel = shape.linear
            _add_hybrid_keys(writer, key_heads=hk, value_heads=hv, key_dim=width, value_dim=width, kernel=kernel,
                             every=shape.full_every, shared_ffn=shape.shared_ffn, mtp=shape.mtp)
        if shape.window:
            writer.add_sliding_window(shape.window)
        if shape.arch == "gemma2":
            from kvchat.engine.model.gguf_arch import GEMMA2_ATTN_SOFTCAP, GEMMA2_FINAL_SOFTCAP
            writer.add_attn_logit_softcapping(GEMMA2_ATTN_SOFTCAP)
            writer.add_final_logit_softcapping(GEMMA2_FINAL_SOFTCAP)
        if shape.yarn:
            _add_yarn_keys(writer, *shape.yarn)
        writer.add_file_type(int(MIXES[qtype][2]))
        writer.add_quantization_version(2)
        vocab = _copy_tokenizer(writer, Path(vocab_from), shape.vocab, cut=True)
        writer.add_vocab_size(vocab)

        plan = tensor_plan(shape, qtype, vocab, per_expert)
        for _, name, dims, kind, _ in plan:
            # the shape is given in numpy order [out, in]; the writer stores it reversed, ggml's [in, out]
            writer.add_tensor_info(name, dims, np.dtype(np.float32), _nbytes(dims, kind),
                                   raw_dtype=GGMLQuantizationType[kind])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        if not weights:             # the data region as one sparse run of zeros, each tensor at its aligned offset
            fout, align = writer.fout[0], writer.data_alignment
            size = sum(writer.ggml_pad(_nbytes(dims, kind), align) for _, _, dims, kind, _ in plan)
            start = writer.ggml_pad(fout.tell(), align)
            fout.truncate(start + size)
            for _, name, dims, kind, _ in plan:     # a constant table (Gemma 4's rope_freqs) is written all the same
                if name == "rope_freqs.weight":
                    fout.seek(start)
                    fout.write(gemma4_rope_freqs(shape).tobytes())
                start += writer.ggml_pad(_nbytes(dims, kind), align)
            return path
        logical = dict(enumerate(_tensors(shape, vocab)))
        stack = None
        for index, name, dims, kind, expert in plan:
            rng = np.random.default_rng([seed, index])
            if expert is None:
                writer.write_tensor_data(_weights(name, dims, kind, rng, shape))
                continue
            if expert == 0:         # the logical 3-D tensor, generated once as a stacked one, written a slice each
                stack = _weights(logical[index][0], logical[index][1], kind, rng, shape)
            writer.write_tensor_data(np.ascontiguousarray(stack[expert]))
    return path


def tensor_plan(shape: ModelShape, qtype: str, vocab: int, per_expert: bool = False) -> list[tuple]:
    """Every tensor a random file of `shape` holds, in file order: (index of its logical tensor in _tensors, GGUF
    name, numpy shape, type, expert or None); per_expert: each 3-D expert tensor as one 2-D tensor per expert."""
    plan = []
    for index, (name, dims) in enumerate(_tensors(shape, vocab)):
        if per_expert and len(dims) == 3:
            parts = split_experts(name, dims)
            kind = file_type(qtype, parts[0][0], dims[1:], shape.blocks, shape.tied, shape.experts)
            plan += [(index, part, part_dims, kind, e) for e, (part, part_dims) in enumerate(parts)]
        else:
            plan.append((index, name, dims, file_type(qtype, name, dims, shape.blocks, shape.tied, shape.experts),
                         None))
    return plan


def planned_bytes(shape: ModelShape | str, qtype: str, layers: int | None = None) -> int:
    """The tensor bytes a random file of this preset (cut to `layers`) holds, without writing it."""
    shape = preset(shape) if isinstance(shape, str) else shape
    shape = cut_layers(shape, layers) if layers else shape
    vocab = shape.vocab or 49152           # the default tokenizer's own size
    return sum(_nbytes(dims, kind) for _, _, dims, kind, _ in tensor_plan(shape, qtype, vocab))


def _add_moe_keys(writer: GGUFWriter, arch: str, experts: int, used: int, ffn: int) -> None:
    """The expert counts llama.cpp reads (and the experts' intermediate size, which a llama file does not store:
    it reads feed_forward_length)."""
    if not experts:
        return
    writer.add_expert_count(experts)
    writer.add_expert_used_count(used)
    if arch != "llama":
        writer.add_expert_feed_forward_length(ffn)


def _add_hybrid_keys(writer: GGUFWriter, *, key_heads: int, value_heads: int, key_dim: int, value_dim: int,
                     kernel: int, every: int, sections: tuple[int, ...] = QWEN35_ROPE_SECTIONS, shared_ffn: int = 0,
                     mtp: int = 0) -> None:
    """Qwen3.5's keys as llama.cpp's converter writes them (its Qwen3-Next ones): the Gated DeltaNet's shape under
    mamba's ssm.* names (state_size: a key head's width, group_count: the key heads, time_step_rank: the value
    heads, inner_size: all value heads' width), the full-attention interval, the rotary sections (the config's
    mrope_section padded to 4; llama.cpp requires them), the shared expert's size and the MTP blocks counted in
    block_count."""
    writer.add_ssm_conv_kernel(kernel)
    writer.add_ssm_state_size(key_dim)
    writer.add_ssm_group_count(key_heads)
    writer.add_ssm_time_step_rank(value_heads)
    writer.add_ssm_inner_size(value_dim * value_heads)
    writer.add_full_attention_interval(every)
    writer.add_rope_dimension_sections([int(n) for n in sections] + [0] * (4 - len(sections)))
    if shared_ffn:
        writer.add_expert_shared_feed_forward_length(shared_ffn)
    if mtp:
        writer.add_nextn_predict_layers(mtp)


def _add_yarn_keys(writer: GGUFWriter, factor: float, original: int, beta_fast: float = 32.0,
                   beta_slow: float = 1.0) -> None:
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(factor))
    writer.add_rope_scaling_orig_ctx_len(int(original))
    writer.add_rope_scaling_yarn_beta_fast(float(beta_fast))
    writer.add_rope_scaling_yarn_beta_slow(float(beta_slow))


def preset(name: str) -> ModelShape:
    """The preset named `name`; a ValueError naming the presets otherwise."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: one of {', '.join(PRESETS)}")
    return PRESETS[name]


def bench_model_path(name: str, qtype: str, layers: int | None = None) -> Path:
    """The random preset `name` in mix `qtype` (its first `layers` layers where given), in the user cache dir:
    written on the first call, then reused."""
    from kvchat.engine.paths import bench_models_dir
    shape = preset(name)
    cut = f"-{layers}L" if layers is not None and layers != shape.layers else ""
    path = bench_models_dir() / f"{name}{cut}-{qtype}.gguf"
    if not path.is_file():
        write_random_gguf(path, shape, qtype, layers=layers)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvchat.bench.gguf_writer",
                                     description="write a random-weight GGUF with a real model's shapes")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-3.2-1b")
    parser.add_argument("--type", dest="qtype", choices=list(MIXES), default="Q4_0")
    parser.add_argument("--layers", type=int, default=None,
                        help="keep the first N layers (a layer's per-token work is what benchmarks compare)")
    parser.add_argument("--per-expert", action="store_true",
                        help="one 2-D tensor per expert, as Mixtral's older GGUFs (arch llama only)")
    parser.add_argument("--out", help="file to write (default: the bench-models cache, reused if present)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.per_expert and not args.out:
        parser.error("--per-expert writes a file of its own: give it with --out")
    if args.out:
        path = write_random_gguf(args.out, args.preset, args.qtype, seed=args.seed, layers=args.layers,
                                 per_expert=args.per_expert)
    else:
        path = bench_model_path(args.preset, args.qtype, args.layers)
    print(f"{path}  {path.stat().st_size / 2**20:.1f} MiB  ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
