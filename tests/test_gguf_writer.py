"""Random-weight GGUF writer: Q4_K / Q6_K quantizers checked by gguf's own dequantizer, and tiny files read back."""
import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import Q4_K, dequantize

from kvchat.bench.gguf_quant import quantize, quantize_q4_k, quantize_q6_k
from kvchat.bench.gguf_writer import bench_model_path, write_random_gguf


def _rows() -> np.ndarray:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((9, 512), dtype=np.float32) * np.float32(0.02)
    x[1] *= 100                      # a large row
    x[2] *= 1e-3                     # a small one
    x[3] = 0                         # all zero
    x[4] = 0.37                      # constant, positive
    x[5] = -0.05                     # constant, negative
    x[6, 100] = 1.5                  # one outlier
    x[7] = np.abs(x[7])              # all >= 0
    x[8] = -np.abs(x[8])             # all <= 0
    return x


def test_q4_k_round_trip():
    """Q4_K bytes decode with gguf's dequantizer to within half a step of each 32-value sub-block."""
    x = _rows()
    q = quantize_q4_k(x)
    assert q.dtype == np.uint8 and q.shape == (9, 2 * 144)
    y = dequantize(q, GGMLQuantizationType.Q4_K)
    assert y.shape == x.shape and np.isfinite(y).all()
    blocks = q.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    sc, _ = Q4_K.get_scale_min(blocks[:, 4:16])
    step = np.repeat((d * sc.astype(np.float32)).reshape(9, 16), 32, axis=1)
    err = np.abs(y - x)
    assert (err <= step * 0.5 * (1 + 1e-3) + 1e-9).all()
    assert err[3].max() == 0 and err[4].max() < 1e-3 and err[5].max() < 1e-4
    rel = err[[0, 1, 2, 7, 8]].mean(axis=1) / np.abs(x[[0, 1, 2, 7, 8]]).mean(axis=1)
    assert (rel < 0.1).all(), rel


def test_q6_k_round_trip():
    """Q6_K bytes decode with gguf's dequantizer to within half a step of each 16-value sub-block."""
    x = _rows()
    q = quantize_q6_k(x)
    assert q.dtype == np.uint8 and q.shape == (9, 2 * 210)
    y = dequantize(q, GGMLQuantizationType.Q6_K)
    assert y.shape == x.shape and np.isfinite(y).all()
    blocks = q.reshape(-1, 210)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    step = np.repeat((d * sc).reshape(9, 32), 16, axis=1)
    err = np.abs(y - x)
    assert (err <= step * 0.5 * (1 + 1e-3) + 1e-9).all()
    assert err[3].max() == 0 and err[4].max() < 1e-3 and err[5].max() < 1e-3
    rel = err[[0, 1, 2, 7, 8]].mean(axis=1) / np.abs(x[[0, 1, 2, 7, 8]]).mean(axis=1)
    assert (rel < 0.03).all(), rel


def test_quantize_dispatches_to_gguf():
    """quantize() gives F32 values as they are and other types in gguf-py's own bytes."""
    x = _rows()
    assert quantize(x, "F32").dtype == np.float32
    q = quantize(x, "Q8_0")
    assert np.array_equal(q, gguf.quants.quantize(x, GGMLQuantizationType.Q8_0))
    err = np.abs(dequantize(q, GGMLQuantizationType.Q8_0) - x)
    assert (err <= np.abs(x).max(axis=1, keepdims=True) / 127 + 1e-5).all()      # + float16 scale rounding


def _expected_types(mix: str) -> dict[str, str]:
    names = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    out = {"token_embd.weight": {"Q4_0": "Q8_0", "Q8_0": "Q8_0", "Q4_K_M": "Q6_K"}[mix], "output_norm.weight": "F32"}
    for i in range(2):
        out[f"blk.{i}.attn_norm.weight"] = out[f"blk.{i}.ffn_norm.weight"] = "F32"
        for n in names:
            out[f"blk.{i}.{n}.weight"] = {"Q4_0": "Q4_0", "Q8_0": "Q8_0", "Q4_K_M": "Q4_K"}[mix]
    if mix == "Q4_K_M":    # llama.cpp's use_more_bits: of 2 layers, only the last gets Q6_K attn_v / ffn_down
        out["blk.1.attn_v.weight"] = out["blk.1.ffn_down.weight"] = "Q6_K"
    return out


@pytest.mark.parametrize("mix", ["Q4_0", "Q8_0", "Q4_K_M"])
def test_tiny_model_reads_back(tmp_path, mix):
    """A tiny random model reads back as llama with its shapes, per-tensor types and the copied tokenizer."""
    path = write_random_gguf(tmp_path / f"tiny-{mix}.gguf", "tiny", mix)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    r = GGUFReader(path)
    field = lambda key: r.fields[key].contents()  # noqa: E731
    assert field("general.architecture") == "llama" and field("llama.block_count") == 2
    assert field("llama.embedding_length") == 256 and field("llama.attention.head_count_kv") == 2
    assert field("llama.rope.dimension_count") == 64 and field("llama.vocab_size") == 49152
    assert len(field("tokenizer.ggml.tokens")) == 49152 and len(field("tokenizer.ggml.merges")) > 0
    assert "im_start" in field("tokenizer.chat_template")
    assert not any(k.startswith("general.") and k not in ("general.architecture", "general.name",
                   "general.file_type", "general.quantization_version") for k in r.fields)
    shapes = {"token_embd.weight": (49152, 256), "output_norm.weight": (256,)}
    for i in range(2):
        shapes |= {f"blk.{i}.attn_norm.weight": (256,), f"blk.{i}.ffn_norm.weight": (256,),
                   f"blk.{i}.attn_q.weight": (256, 256), f"blk.{i}.attn_k.weight": (128, 256),
                   f"blk.{i}.attn_v.weight": (128, 256), f"blk.{i}.attn_output.weight": (256, 256),
                   f"blk.{i}.ffn_gate.weight": (512, 256), f"blk.{i}.ffn_up.weight": (512, 256),
                   f"blk.{i}.ffn_down.weight": (256, 512)}
    types = _expected_types(mix)
    assert sorted(t.name for t in r.tensors) == sorted(shapes)
    for t in r.tensors:
        assert list(t.shape) == list(reversed(shapes[t.name])), t.name        # ggml order: [in, out]
        assert t.tensor_type.name == types[t.name], t.name
        if t.tensor_type.name != "F32":
            w = dequantize(t.data[:64], t.tensor_type)
            assert w.shape == (min(64, shapes[t.name][0]), shapes[t.name][1]), t.name
            assert 0.01 < w.std() < 0.03, t.name
        else:
            assert ((t.data >= 0.9) & (t.data <= 1.1)).all(), t.name


def test_bench_model_written_once(tmp_path, monkeypatch):
    """bench_model_path writes the model into the cache dir on first use and reuses it afterwards."""
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path))
    path = bench_model_path("tiny", "Q8_0")
    assert path == tmp_path / "bench-models" / "tiny-Q8_0.gguf" and path.is_file()
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    stamp = path.stat().st_mtime_ns
    assert bench_model_path("tiny", "Q8_0") == path and path.stat().st_mtime_ns == stamp
