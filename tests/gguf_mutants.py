"""Tiny llama GGUFs (Q8_0 weights, the default model's tokenizer) written from a plan that a test may mutate:
header fields changed, retyped or removed, tensors given other shapes or dropped. Fast to write (no quantizer:
the Q8_0 blocks are made directly), so a fuzz test can write one per example."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from kvchat.bench.gguf_writer import _tokenizer_fields, atomic_writer
from kvchat.engine.model.source import default_gguf_path
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 2, 1, 32, 128, 2
MISSING = object()          # a field value: the key is left out


def base_fields() -> dict[str, object]:
    """The header's architecture fields (GGUF key -> value)."""
    return {"llama.block_count": LAYERS, "llama.context_length": 256, "llama.embedding_length": HIDDEN,
            "llama.feed_forward_length": FFN, "llama.attention.head_count": HEADS,
            "llama.attention.head_count_kv": KV_HEADS, "llama.rope.freq_base": 10000.0,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.dimension_count": HEAD_DIM,
            "llama.attention.key_length": HEAD_DIM, "llama.attention.value_length": HEAD_DIM}


def base_tensors(vocab: int) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy shape [out, in], as llama.cpp's converter writes them (tied head: no output)."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out = {"token_embd.weight": (vocab, HIDDEN)}
    for i in range(LAYERS):
        p = f"blk.{i}."
        out.update({p + "attn_norm.weight": (HIDDEN,), p + "attn_q.weight": (q, HIDDEN),
                    p + "attn_k.weight": (kv, HIDDEN), p + "attn_v.weight": (kv, HIDDEN),
                    p + "attn_output.weight": (HIDDEN, q), p + "ffn_norm.weight": (HIDDEN,),
                    p + "ffn_gate.weight": (FFN, HIDDEN), p + "ffn_up.weight": (FFN, HIDDEN),
                    p + "ffn_down.weight": (HIDDEN, FFN)})
    out["output_norm.weight"] = (HIDDEN,)
    return out


def tokenizer_fields():
    source = default_gguf_path()
    return _tokenizer_fields(str(source), source.stat().st_mtime_ns)


def vocab_size() -> int:
    return next(len(v) for k, v, *_ in tokenizer_fields() if k == "tokenizer.ggml.tokens")


def _vtype(value) -> GGUFValueType:
    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, str):
        return GGUFValueType.STRING
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if value < 0:
        return GGUFValueType.INT32 if value >= -2**31 else GGUFValueType.INT64
    return GGUFValueType.UINT32 if value < 2**32 else GGUFValueType.UINT64


def _data(shape: tuple[int, ...], rng: np.random.Generator) -> tuple[np.ndarray, GGMLQuantizationType]:
    if len(shape) == 1:                          # norms: float32 near 1
        return rng.uniform(0.9, 1.1, shape).astype(np.float32), GGMLQuantizationType.F32
    rows, cols = math.prod(shape[:-1]), shape[-1]
    blocks = rows * -(-cols // 32)               # a ragged row still gets whole blocks' bytes
    raw = np.empty((blocks, 34), dtype=np.uint8)
    raw[:, :2] = np.array([0.004], np.float16).view(np.uint8)          # scale: values within +-0.5
    raw[:, 2:] = rng.integers(-127, 128, (blocks, 32), dtype=np.int8).view(np.uint8)
    return raw.reshape(-1), GGMLQuantizationType.Q8_0


def write(path: Path, fields: dict[str, object] | None = None, tensors: dict[str, tuple[int, ...] | None] | None = None,
          seed: int = 0) -> Path:
    """A tiny GGUF at path: base_fields() updated by fields (MISSING drops a key), base_tensors() updated by
    tensors (None drops one). Each tensor's values depend on its name and the seed only."""
    fields = {**base_fields(), **(fields or {})}
    plan = {**base_tensors(vocab_size()), **(tensors or {})}
    path = Path(path)
    with atomic_writer(path, "llama") as writer:
        writer.add_name("tiny fuzz base")
        for key, value in fields.items():
            if value is not MISSING:
                writer.add_key_value(key, value, _vtype(value))
        writer.add_file_type(7)                 # MOSTLY_Q8_0
        for key, value, vtype, sub in tokenizer_fields():
            writer.add_key_value(key, value, vtype, sub)
        made = []
        for name, shape in plan.items():
            if shape is None:
                continue
            rng = np.random.default_rng([seed, *name.encode()])
            data, kind = _data(shape, rng)
            writer.add_tensor_info(name, shape, np.dtype(np.float32), data.nbytes, raw_dtype=kind)
            made.append(data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for data in made:
            writer.write_tensor_data(data)
    return path
