"""Write random-weight GGUF files with real architectures' shapes (benchmarks) or tiny ones (tests).

The files are what llama.cpp's converter and quantizer would write for arch "llama": the same metadata
keys, GGUF tensor names, q/k rows permuted for llama.cpp's rotary layout, and a per-tensor type mix
close to llama.cpp's defaults. The tokenizer (every `tokenizer.*` field, chat template included) is
copied from the default model's GGUF, so llama.cpp and transformers can load the result.

gguf-py quantizes Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16 and BF16; Q4_K and Q6_K are quantized here, in
numpy, into the exact block layouts gguf's dequantizer reads. Their scales are rounded up (not to the
nearest level) so that every sub-block's grid covers all its values: the error of each weight is then at
most half a step of its sub-block.

    python -m bench.gguf_writer --preset llama-3.2-1b --type Q4_0 [--out PATH]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize as gguf_quantize

QK_K = 256
CHUNK_ELEMENTS = 1 << 24          # rows are generated and quantized ~16M values (64 MiB of fp32) at a time


# ----------------------------------------------------------------------------------------- quantizers

def _f16_at_least(v: np.ndarray) -> np.ndarray:
    """The smallest float16 >= v (v >= 0, float32), returned as float32."""
    h = v.astype(np.float16)
    low = h.astype(np.float32) < v
    if low.any():
        h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h.astype(np.float32)


def _ceil_ratio(num: np.ndarray, den: np.ndarray, top: int) -> np.ndarray:
    """ceil(num / den) clipped to 0..top, 0 where den == 0 (den broadcasts against num)."""
    den = np.broadcast_to(den, num.shape)
    out = np.zeros(num.shape, dtype=np.float32)
    np.divide(num, den, out=out, where=den > 0)
    return np.clip(np.ceil(out), 0, top)


def _rows(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % QK_K:
        raise ValueError(f"expected [rows, K] with K a multiple of {QK_K}, got {x.shape}")
    return x


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K % 256 == 0) -> Q4_K blocks, uint8 [rows, K // 256 * 144].

    Block of 256 = 8 sub-blocks of 32; w = d * sc_j * q - dmin * mn_j with q in 0..15 and 6-bit sc, mn.
    """
    x = _rows(x)
    rows, k = x.shape
    b = x.reshape(-1, 8, 32)
    n = b.shape[0]
    m = -np.minimum(b.min(axis=-1), 0)                                # [n, 8] >= 0: the sub-block's -min
    dmin = _f16_at_least(m.max(axis=-1) / 63)                         # [n]
    mn = _ceil_ratio(m, dmin[:, None], 63)                            # dmin * mn >= m: the grid starts at or below min
    span = np.maximum(b.max(axis=-1) + dmin[:, None] * mn, 0)         # from the grid's bottom to the max
    d = _f16_at_least(span.max(axis=-1) / (15 * 63))
    sc = _ceil_ratio(span / 15, d[:, None], 63)                       # 15 * d * sc >= span: it reaches the max
    step = (d[:, None] * sc)[..., None]
    zero = (dmin[:, None] * mn)[..., None]
    q = np.zeros(b.shape, dtype=np.float32)
    np.divide(b + zero, step, out=q, where=step > 0)
    q = np.clip(np.rint(q), 0, 15).astype(np.uint8)

    sc = sc.astype(np.uint8)
    mn = mn.astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
                             mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)], axis=-1)
    q = q.reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    blocks = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(n, 2),
                             dmin.astype(np.float16).view(np.uint8).reshape(n, 2),
                             scales, qs], axis=-1)
    return blocks.reshape(rows, k // QK_K * 144)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K % 256 == 0) -> Q6_K blocks, uint8 [rows, K // 256 * 210].

    Block of 256 = 16 sub-blocks of 16; w = d * sc_j * (q - 32) with q in 0..63 and int8 sc.
    """
    x = _rows(x)
    rows, k = x.shape
    b = x.reshape(-1, 16, 16)
    n = b.shape[0]
    s = np.abs(b).max(axis=-1) / 31                                   # [n, 16]
    d = _f16_at_least(s.max(axis=-1) / 127)
    sc = _ceil_ratio(s, d[:, None], 127)                              # 31 * d * sc >= amax: nothing clips
    step = (d[:, None] * sc)[..., None]
    q = np.zeros(b.shape, dtype=np.float32)
    np.divide(b, step, out=q, where=step > 0)
    q = (np.clip(np.rint(q), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)

    ql = ((q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)).reshape(n, 128)
    hi = ((q >> 4) & 0x03).reshape(n, 2, 4, 32)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
    blocks = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8),
                             d.astype(np.float16).view(np.uint8).reshape(n, 2)], axis=-1)
    return blocks.reshape(rows, k // QK_K * 210)


def quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    """float32 [rows, K] -> the bytes (or float16 / float32 values) a GGUF stores for type_name."""
    if type_name == "F32":
        return np.asarray(x, dtype=np.float32)
    if type_name == "Q4_K":
        return quantize_q4_k(x)
    if type_name == "Q6_K":
        return quantize_q6_k(x)
    return gguf_quantize(np.asarray(x, dtype=np.float32), GGMLQuantizationType[type_name])


# ------------------------------------------------------------------------------------ shapes and mixes

@dataclass(frozen=True)
class ModelShape:
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


PRESETS = {
    "tiny": ModelShape("tiny", 2, 256, 4, 2, 512, 64, 2048, 10000.0, True),
    "llama-3.2-1b": ModelShape("llama-3.2-1b", 16, 2048, 32, 8, 8192, 64, 8192, 500000.0, True),
    "llama-3.2-3b": ModelShape("llama-3.2-3b", 28, 3072, 24, 8, 8192, 128, 8192, 500000.0, True),
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
}


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


def _tensors(shape: ModelShape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape [out, in]) in the order llama.cpp's converter writes them."""
    h, q, kv, f = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    out = [("token_embd.weight", (vocab, h))]
    for i in range(shape.layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (h,)), (p + "attn_q.weight", (q, h)), (p + "attn_k.weight", (kv, h)),
                (p + "attn_v.weight", (kv, h)), (p + "attn_output.weight", (h, q)), (p + "ffn_norm.weight", (h,)),
                (p + "ffn_gate.weight", (f, h)), (p + "ffn_up.weight", (f, h)), (p + "ffn_down.weight", (h, f))]
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
    if name.endswith((".attn_q.weight", ".attn_k.weight")):
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


def _copy_tokenizer(writer: GGUFWriter, source: Path) -> int:
    """Copy every tokenizer.* field of `source` into writer; return the vocabulary size."""
    vocab = 0
    for key, value, vtype, sub in _tokenizer_fields(str(source), source.stat().st_mtime_ns):
        writer.add_key_value(key, value, vtype, sub)
        if key == "tokenizer.ggml.tokens":
            vocab = len(value)
    if not vocab:
        raise ValueError(f"{source} has no tokenizer.ggml.tokens")
    return vocab


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


def write_random_gguf(path: str | os.PathLike, shape: ModelShape | str, qtype: str, seed: int = 0,
                      vocab_from: str | os.PathLike | None = None) -> Path:
    """Write a random-weight llama GGUF of `shape` in mix `qtype` to `path` and return the path.

    The file appears complete or not at all (written under a temporary name, then renamed). At most one
    tensor's quantized bytes and one chunk of fp32 values are held at a time.
    """
    if isinstance(shape, str):
        shape = PRESETS[shape]
    if qtype not in MIXES:
        raise ValueError(f"unknown type {qtype!r}: one of {', '.join(MIXES)}")
    if vocab_from is None:
        from engine.model.source import default_gguf_path
        vocab_from = default_gguf_path()
    path = Path(path)
    with atomic_writer(path, "llama") as writer:
        writer.add_name(f"random {shape.name} {qtype}")
        writer.add_block_count(shape.layers)
        writer.add_context_length(shape.context)
        writer.add_embedding_length(shape.hidden)
        writer.add_feed_forward_length(shape.intermediate)
        writer.add_head_count(shape.heads)
        writer.add_head_count_kv(shape.kv_heads)
        writer.add_rope_freq_base(shape.rope_theta)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_rope_dimension_count(shape.head_dim)
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
        writer.add_file_type(int(MIXES[qtype][2]))
        writer.add_quantization_version(2)
        vocab = _copy_tokenizer(writer, Path(vocab_from))
        writer.add_vocab_size(vocab)

        plan = [(name, dims, tensor_type(qtype, name, shape.layers, shape.tied))
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


def bench_model_path(preset: str, qtype: str) -> Path:
    """The random `preset` model in mix `qtype`, in the user cache dir: written on the first call, then reused."""
    from engine.model.source import cache_root
    path = cache_root() / "bench-models" / f"{preset}-{qtype}.gguf"
    if not path.is_file():
        write_random_gguf(path, preset, qtype)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gguf_writer",
                                     description="write a random-weight llama GGUF with a real model's shapes")
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
