"""Write GGUF files as llama.cpp's converter and quantizer would: random weights with real architectures' shapes
(benchmarks) or tiny ones (tests), and a Hugging Face folder's own weights (write_gguf_from_hf).

The files carry llama.cpp's metadata keys and tensor names for their architecture (llama, qwen3, gemma2,
gemma3, phi3: engine/gguf/arch.py names what each stores), q/k rows permuted for llama.cpp's rotary layout
where its converter permutes them (llama), Gemma's norms stored as 1 + w as its converter stores them, and a
per-tensor type mix close to llama.cpp's defaults (bench/gguf_quant.py quantizes). A random model's
tokenizer (every `tokenizer.*` field, chat template included) is copied from the default model's GGUF and
padded with unused tokens to the preset's vocabulary; a folder's byte-level BPE tokenizer is written as
its own. llama.cpp and transformers load the results.

    python -m bench.gguf_writer --preset llama-3.2-1b --type Q4_0 [--out PATH]

(~490 lines: the random writer and the folder writer share the metadata, type and name rules above them,
which is what keeps the two kinds of file alike.)
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType, RopeScalingType
from gguf.constants import GGML_QUANT_SIZES

from kvchat.bench.gguf_quant import QK_K, quantize

CHUNK_ELEMENTS = 1 << 24          # rows are generated and quantized ~16M values (64 MiB of fp32) at a time


# ------------------------------------------------------------------------------------ shapes and mixes

@dataclass(frozen=True)
class ModelShape:
    """A model's shape as its GGUF stores it. arch: the GGUF architecture (llama, qwen3, gemma3); vocab: the
    real vocabulary, to which the copied default tokenizer is padded (None: the tokenizer's own); window:
    Gemma 3's sliding window (every sixth layer global, as llama.cpp reads the arch)."""
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


PRESETS = {
    "tiny": ModelShape("tiny", 2, 256, 4, 2, 512, 64, 2048, 10000.0, True),
    "smollm2-135m": ModelShape("smollm2-135m", 30, 576, 9, 3, 1536, 64, 8192, 100000.0, True),   # the default's shape
    "llama-3.2-1b": ModelShape("llama-3.2-1b", 16, 2048, 32, 8, 8192, 64, 8192, 500000.0, True),
    "llama-3.2-3b": ModelShape("llama-3.2-3b", 28, 3072, 24, 8, 8192, 128, 8192, 500000.0, True),
    "qwen3-0.6b": ModelShape("qwen3-0.6b", 28, 1024, 16, 8, 3072, 128, 40960, 1e6, True, arch="qwen3",
                             vocab=151936, rms_norm_eps=1e-6),
    "gemma-3-1b": ModelShape("gemma-3-1b", 26, 1152, 4, 1, 6912, 256, 32768, 1e6, True, arch="gemma3",
                             vocab=262144, window=512, rms_norm_eps=1e-6),
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
    "F16": ("F16", "F16", LlamaFileType.MOSTLY_F16),
    "BF16": ("BF16", "BF16", LlamaFileType.MOSTLY_BF16),
    "F32": ("F32", "F32", LlamaFileType.ALL_F32),
}
# llama.cpp's quantizer's type for rows that are not whole 256-value super-blocks (Gemma 3 1B's hidden 1152)
_SHORT_ROW_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the Q4_K_M layers whose attn_v and ffn_down get Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(mix: str, name: str, layers: int, tied: bool) -> str:
    """The type llama.cpp's quantizer would give tensor `name` (GGUF name) in this mix.

    1-D norms are F32. Q4_K_M follows llama.cpp: output (and token_embd when tied to it) Q6_K, untied
    token_embd Q4_K, attn_v and ffn_down Q6_K in the use_more_bits layers, Q4_K elsewhere.
    """
    if mix not in MIXES:
        raise ValueError(f"unknown type {mix!r}: one of {', '.join(MIXES)}")
    base, edge, _ = MIXES[mix]
    if name.endswith("_norm.weight"):
        return "F32"
    if name == "output.weight" or (name == "token_embd.weight" and tied):
        return edge
    if name == "token_embd.weight":
        return base if mix == "Q4_K_M" else edge
    if mix == "Q4_K_M" and name.endswith((".attn_v.weight", ".ffn_down.weight")):
        return "Q6_K" if use_more_bits(int(name.split(".")[1]), layers) else base
    return base


def file_type(mix: str, name: str, numpy_shape: tuple[int, ...], layers: int, tied: bool) -> str:
    """tensor_type, with llama.cpp's rules for what it cannot hold: 1-D tensors (norms, biases, rope factors)
    F32, a K-quant of rows that are not whole super-blocks its fallback type."""
    if len(numpy_shape) == 1:
        return "F32"
    kind = tensor_type(mix, name, layers, tied)
    if kind in _SHORT_ROW_FALLBACK and numpy_shape[-1] % QK_K:
        kind = _SHORT_ROW_FALLBACK[kind]
    block = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0]
    return kind if numpy_shape[-1] % block == 0 else "F32"


# a layer's extra tensors beyond the Llama ones, per GGUF architecture: qk: q / k norms, post: Gemma's post-norms
_QK_NORMS = {"qwen3", "gemma3"}
_POST_NORMS = {"gemma2", "gemma3"}


def _tensors(shape: ModelShape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape [out, in]) in the order llama.cpp's converter writes them."""
    h, q, kv, f = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    out = [("token_embd.weight", (vocab, h))]
    for i in range(shape.layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (h,)), (p + "attn_q.weight", (q, h)), (p + "attn_k.weight", (kv, h)),
                (p + "attn_v.weight", (kv, h)), (p + "attn_output.weight", (h, q))]
        if shape.arch in _QK_NORMS:
            out += [(p + "attn_q_norm.weight", (shape.head_dim,)), (p + "attn_k_norm.weight", (shape.head_dim,))]
        if shape.arch in _POST_NORMS:
            out.append((p + "post_attention_norm.weight", (h,)))
        out += [(p + "ffn_norm.weight", (h,)), (p + "ffn_gate.weight", (f, h)), (p + "ffn_up.weight", (f, h)),
                (p + "ffn_down.weight", (h, f))]
        if shape.arch in _POST_NORMS:
            out.append((p + "post_ffw_norm.weight", (h,)))
    out.append(("output_norm.weight", (h,)))
    if not shape.tied:
        out.append(("output.weight", (vocab, h)))
    return out


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
    """One tensor's random weights in its file type; fp32 is made a chunk of rows at a time (q / k whole)."""
    if len(numpy_shape) == 1:
        return rng.uniform(0.9, 1.1, numpy_shape).astype(np.float32)
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


def _copy_tokenizer(writer: GGUFWriter, source: Path, vocab: int | None = None) -> int:
    """Copy every tokenizer.* field of `source` into writer, the vocabulary padded with unused tokens
    (`<unused{n}>`, type UNUSED, score 0) to `vocab` entries when it is larger; return the vocabulary size."""
    fields = _tokenizer_fields(str(source), source.stat().st_mtime_ns)
    tokens = next((value for key, value, _, _ in fields if key == "tokenizer.ggml.tokens"), None)
    if not tokens:
        raise ValueError(f"{source} has no tokenizer.ggml.tokens")
    pad = max(0, (vocab or 0) - len(tokens))
    padding = {"tokenizer.ggml.tokens": [f"<unused{n}>" for n in range(pad)],
               "tokenizer.ggml.token_type": [5] * pad, "tokenizer.ggml.scores": [0.0] * pad}
    for key, value, vtype, sub in fields:
        if pad and key in padding:
            value = list(value) + padding[key]
        writer.add_key_value(key, value, vtype, sub)
    return len(tokens) + pad


def _add_shape_keys(writer: GGUFWriter, arch: str, *, layers: int, hidden: int, heads: int, kv_heads: int,
                    ffn: int, head_dim: int, context: int, theta: float, eps: float, rotary_dims: int) -> None:
    """The keys every architecture here stores, in the order llama.cpp's converter writes them."""
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
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
                      vocab_from: str | os.PathLike | None = None) -> Path:
    """Write a random-weight GGUF of `shape` (its arch) in mix `qtype` to `path` and return the path.

    The file appears complete or not at all (written under a temporary name, then renamed). At most one
    tensor's quantized bytes and one chunk of fp32 values are held at a time.
    """
    if isinstance(shape, str):
        shape = preset(shape)
    if qtype not in MIXES:
        raise ValueError(f"unknown type {qtype!r}: one of {', '.join(MIXES)}")
    if vocab_from is None:       # KVCHAT_VOCAB_GGUF: a GGUF holding the tokenizer, where the default model is not
        from kvchat.engine.model.source import default_gguf_path        # installed (packaging/gpu_check.sh carries one)
        vocab_from = os.environ.get("KVCHAT_VOCAB_GGUF") or default_gguf_path()
    path = Path(path)
    with atomic_writer(path, shape.arch) as writer:
        writer.add_name(f"random {shape.name} {qtype}")
        _add_shape_keys(writer, shape.arch, layers=shape.layers, hidden=shape.hidden, heads=shape.heads,
                        kv_heads=shape.kv_heads, ffn=shape.intermediate, head_dim=shape.head_dim,
                        context=shape.context, theta=shape.rope_theta, eps=shape.rms_norm_eps,
                        rotary_dims=shape.head_dim)
        if shape.window:
            writer.add_sliding_window(shape.window)
        writer.add_file_type(int(MIXES[qtype][2]))
        writer.add_quantization_version(2)
        vocab = _copy_tokenizer(writer, Path(vocab_from), shape.vocab)
        writer.add_vocab_size(vocab)

        plan = [(name, dims, file_type(qtype, name, dims, shape.layers, shape.tied))
                for name, dims in _tensors(shape, vocab)]
        for name, dims, kind in plan:
            # the shape is given in numpy order [out, in]; the writer stores it reversed, ggml's [in, out]
            writer.add_tensor_info(name, dims, np.dtype(np.float32), _nbytes(dims, kind),
                                   raw_dtype=GGMLQuantizationType[kind])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for index, (name, dims, kind) in enumerate(plan):
            rng = np.random.default_rng([seed, index])
            writer.write_tensor_data(_weights(name, dims, kind, rng, shape))
    return path


# ------------------------------------------------------------------------------ a Hugging Face folder

# llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w (its norm multiplies by the stored weight)
_NORM_SHIFT = {"gemma2": 1.0, "gemma3": 1.0}


def write_gguf_from_hf(folder: str | os.PathLike, path: str | os.PathLike, qtype: str = "F32") -> Path:
    """Write a Hugging Face folder's model (its weights, config and byte-level BPE tokenizer) as the GGUF
    llama.cpp's converter and quantizer would make of it, in mix `qtype` (MIXES), and return the path.

    A setting llama.cpp does not store but derives from the architecture (Gemma's query scale and window
    pattern, Gemma 3's local RoPE base) must be the one it derives: else a ValueError says which, since the
    file would describe another model.
    """
    from kvchat.engine.gguf.arch import GEMMA3_LOCAL_THETA, layer_types, query_pre_attn_scalar
    from kvchat.engine.model.families import family
    from kvchat.engine.model.source import load_state_dict, read_config

    folder, path = Path(folder), Path(path)
    if qtype not in MIXES:
        raise ValueError(f"unknown type {qtype!r}: one of {', '.join(MIXES)}")
    cfg = read_config(folder)
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

    def derived(what: str, have, llama_cpp) -> None:
        if have != llama_cpp:
            raise ValueError(f"{folder.name}: {what} is {have!r}, but llama.cpp derives {llama_cpp!r} for {arch} "
                             f"(a GGUF does not store it): the file would describe another model")

    state = load_state_dict(folder)
    tied = bool(cfg.get("tie_word_embeddings", False)) or "lm_head.weight" not in state
    with atomic_writer(path, arch) as writer:
        writer.add_name(folder.name)
        _add_shape_keys(writer, arch, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                        ffn=cfg["intermediate_size"], head_dim=head_dim,
                        context=cfg.get("max_position_embeddings", 4096), theta=theta,
                        eps=cfg.get("rms_norm_eps", 1e-6), rotary_dims=rotary)
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
        elif rtype != "default":
            raise ValueError(f"{folder.name}: rope type {rtype!r} is not written here (default, linear, longrope)")
        if arch in ("gemma2", "gemma3"):
            derived("query_pre_attn_scalar", cfg.get("query_pre_attn_scalar", head_dim),
                    query_pre_attn_scalar(arch, layers, hidden, heads, head_dim))
            window = cfg.get("sliding_window")
            expected = layer_types(arch, layers, bool(window))
            derived("layer_types", list(cfg.get("layer_types") or expected), expected)
            if window:
                writer.add_sliding_window(int(window))
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(float(cfg["attn_logit_softcapping"]))
            writer.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
        if arch == "gemma3":
            derived("the sliding layers' rope", (local or {}).get("rope_theta", GEMMA3_LOCAL_THETA), GEMMA3_LOCAL_THETA)
            if cfg.get("final_logit_softcapping"):
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
            if shift and name.endswith("norm.weight"):
                a = a + np.float32(shift)
            kind = file_type(qtype, gname, a.shape, layers, tied)
            data = quantize(np.ascontiguousarray(a), kind) if a.ndim == 2 else np.ascontiguousarray(a)
            writer.add_tensor(gname, data, raw_shape=data.shape if a.ndim == 2 else None,
                              raw_dtype=GGMLQuantizationType[kind] if a.ndim == 2 else None)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    return path


def _gguf_name(hf_name: str, tensors: dict[str, str]) -> tuple[str, str | None]:
    """(llama.cpp's name, the layer module or None) of a Hugging Face weight."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name], None
    _, _, i, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    if module not in tensors:
        raise ValueError(f"weight {hf_name}: llama.cpp has no tensor for {module!r} in this architecture")
    return f"blk.{i}.{tensors[module]}.{kind}", module


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


def preset(name: str) -> ModelShape:
    """The preset named `name`; a ValueError naming the presets otherwise."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: one of {', '.join(PRESETS)}")
    return PRESETS[name]


def bench_model_path(name: str, qtype: str) -> Path:
    """The random preset `name` in mix `qtype`, in the user cache dir: written on the first call, then reused."""
    from kvchat.engine.model.source import cache_root
    shape = preset(name)
    path = cache_root() / "bench-models" / f"{name}-{qtype}.gguf"
    if not path.is_file():
        write_random_gguf(path, shape, qtype)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gguf_writer",
                                     description="write a random-weight GGUF with a real model's shapes")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-3.2-1b")
    parser.add_argument("--type", dest="qtype", choices=list(MIXES), default="Q4_0")
    parser.add_argument("--out", help="file to write (default: the bench-models cache, reused if present)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.out:
        path = write_random_gguf(args.out, args.preset, args.qtype, seed=args.seed)
    else:
        path = bench_model_path(args.preset, args.qtype)
    print(f"{path}  {path.stat().st_size / 2**20:.1f} MiB  ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
