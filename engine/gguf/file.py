"""A GGUF file read in place: metadata, architecture numbers and quantized blocks.

Nothing here converts the file: it is memory-mapped; the 4-bit block types (Q4_0,
Q4_1, Q4_K) are unpacked into codes 0..15 with a scale and zero point per group of 32, which is
exactly their grid; other types are dequantized by `gguf` itself.
"""
from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path

import numpy as np

from engine.model.families import check_architecture

from engine.errors import ModelLoadError
INT4_GRID_TYPES = ("Q4_0", "Q4_1", "Q4_K")     # 16 levels per group of 32: kept as they are
# HF parameter name -> GGUF tensor name (per layer, with {i})
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


# ggml type id -> (name, values per block, bytes per block) of the types Llama-family files use, so that
# reading a header needs no `import gguf` (70 ms); any other id is looked up in gguf's own table
_GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
               7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
               12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 30: ("BF16", 1, 2)}


def ggml_type(type_id: int) -> tuple[str, int, int]:
    """(name, values per block, bytes per block) of a ggml tensor type id."""
    known = _GGML_TYPES.get(type_id)
    if known is not None:
        return known
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    qtype = GGMLQuantizationType(type_id)
    return (qtype.name, *GGML_QUANT_SIZES[qtype])


_SCALAR = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


class _Tensor:
    __slots__ = ("name", "type_name", "shape", "data", "n_bytes", "offset")

    def __init__(self, name: str, type_name: str, shape: tuple[int, ...], data: np.ndarray, offset: int):
        self.name, self.type_name, self.shape, self.data, self.offset = name, type_name, shape, data, offset
        self.n_bytes = int(data.nbytes)


class GGUFFile:
    """Metadata and tensors of one .gguf, memory-mapped.

    Our own header reader: `gguf`'s GGUFReader builds a numpy view for every string of the
    vocabulary (seconds for a 49k-token vocabulary); here arrays are skipped unless asked for.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
            self._read_header()
        except ModelLoadError:
            raise
        except Exception as exc:   # a truncated or foreign file
            raise ModelLoadError(f"{self.path.name} is not a readable GGUF file ({type(exc).__name__}: {exc}); "
                                 f"re-download or re-export it") from exc
        self.arch = self.field("general.architecture")
        check_architecture(str(self.arch), self.path.name)

    # header: magic, version, counts, key/value metadata, tensor infos, aligned data
    def _read_header(self) -> None:
        buf = memoryview(self._map)
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic number")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old")
        pos = 24
        self.fields: dict[str, object] = {}
        for _ in range(n_kv):
            key, pos = _string(buf, pos)
            (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            self.fields[key], pos = _value(buf, pos, vtype)
        infos = []
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            (n_dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos)
            pos += 8 * n_dims
            ttype, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            infos.append((name, dims, ttype, offset))
        align = int(self.fields.get("general.alignment", 32))
        start = (pos + align - 1) // align * align
        self.tensors: dict[str, _Tensor] = {}
        for name, dims, ttype, offset in infos:
            type_name, block, size = ggml_type(ttype)
            if not 1 <= len(dims) <= 4:
                raise ModelLoadError(f"{self.path.name}: tensor {name} has {len(dims)} dimensions (ggml has 1 to 4): "
                                     f"the file is damaged; re-download or re-convert it")
            if dims[0] % block:
                raise ModelLoadError(f"{self.path.name}: tensor {name} has rows of {dims[0]:,} values, not a whole "
                                     f"number of {type_name} blocks of {block}: the file is damaged; re-download or "
                                     f"re-convert it")
            rows = math.prod(dims[1:])
            row_bytes = dims[0] // block * size
            begin = start + offset
            if begin + rows * row_bytes > len(self._map):
                raise ValueError(f"tensor {name} runs past the end of the file (truncated download?)")
            data = self._map[begin:begin + rows * row_bytes].reshape(rows, row_bytes)
            if type_name in ("F32", "F16", "BF16"):
                data = data.view({"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[type_name])
            if len(dims) == 1:
                data = data.reshape(-1)
            self.tensors[name] = _Tensor(name, type_name, tuple(int(d) for d in dims), data, begin)

    def field(self, key: str, default=None):
        value = self.fields.get(key)
        if value is None:
            if default is not None:
                return default
            raise ModelLoadError(f"{self.path.name} lacks the metadata key {key!r}: the file is incomplete")
        return value

    def array(self, key: str) -> list:
        """A metadata array in full (the header reader skips long ones): strings as str, numbers as Python numbers.

        A string that is not UTF-8 raises ModelLoadError (a damaged file)."""
        value = self.field(key)
        if not isinstance(value, SkippedArray):
            if not isinstance(value, list):
                raise ModelLoadError(f"{self.path.name}: the metadata key {key!r} holds a {type(value).__name__}, "
                                     f"not an array: the file is damaged")
            return value
        buf = memoryview(self._map)
        if value.item_type != _STRING:
            dt = np.dtype(_SCALAR[value.item_type])
            return np.frombuffer(buf, dtype=dt, count=value.n, offset=value.offset).tolist()
        out, pos, unpack = [], value.offset, struct.Struct("<Q").unpack_from
        try:
            for _ in range(value.n):
                (m,) = unpack(buf, pos)
                out.append(str(buf[pos + 8:pos + 8 + m], "utf-8"))
                pos += 8 + m
        except UnicodeDecodeError as exc:
            raise ModelLoadError(f"{self.path.name}: item {len(out)} of {key!r} is not UTF-8 text ({exc}): "
                                 f"the file is damaged") from exc
        return out

    def type_name(self, name: str) -> str:
        return self.tensors[name].type_name

    @property
    def tensor_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors.values())

    def quant_summary(self) -> str:
        """The dominant weight type, then the others: "Q4_1 (+Q8_0)"."""
        from collections import Counter
        counts = Counter()
        for t in self.tensors.values():
            if t.type_name != "F32":
                counts[t.type_name] += t.n_bytes
        names = [n for n, _ in counts.most_common()]
        if not names:
            return "F32"
        return names[0] + (f" (+{', '.join(names[1:])})" if len(names) > 1 else "")

    def hf_config(self) -> dict:
        """The architecture numbers in config.json's words, as the header holds them: ModelConfig.from_hf checks
        them, naming each by its key here (key_names)."""
        a = self.arch
        embd = self.tensors.get("token_embd.weight")
        if embd is None:
            raise ModelLoadError(f"{self.path.name} has no token_embd.weight tensor: the file is incomplete")
        if len(embd.shape) != 2:
            raise ModelLoadError(f"{self.path.name}: token_embd.weight has shape {list(embd.shape)}, not [hidden, "
                                 f"vocabulary]: the file is damaged; re-download or re-convert it")
        head_dim = self.fields.get(f"{a}.attention.key_length", self.fields.get(f"{a}.rope.dimension_count"))
        cfg = {
            "model_type": a,
            "vocab_size": int(embd.shape[1]),
            "hidden_size": self.field(f"{a}.embedding_length"),
            "num_hidden_layers": self.field(f"{a}.block_count"),
            "num_attention_heads": self.field(f"{a}.attention.head_count"),
            "num_key_value_heads": self.fields.get(f"{a}.attention.head_count_kv"),
            "head_dim": head_dim,                 # absent: hidden_size // heads, as config.json's default
            "intermediate_size": self.field(f"{a}.feed_forward_length"),
            "rms_norm_eps": self.fields.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self.fields.get(f"{a}.rope.freq_base", 10000.0),
            "max_position_embeddings": self.fields.get(f"{a}.context_length", 4096),
            "tie_word_embeddings": "output.weight" not in self.tensors,
        }
        kind = self.field(f"{a}.rope.scaling.type", "none")
        if kind == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": self.field(f"{a}.rope.scaling.factor")}
        elif kind not in ("none", ""):
            raise ModelLoadError(f"{self.path.name}: unsupported rope scaling {kind!r}: kvchat supports none and linear")
        return cfg

    def key_names(self) -> dict[str, str]:
        """hf_config's keys -> the header's own, for messages."""
        a = self.arch
        return {"vocab_size": "token_embd.weight's rows", "hidden_size": f"{a}.embedding_length",
                "num_hidden_layers": f"{a}.block_count", "num_attention_heads": f"{a}.attention.head_count",
                "num_key_value_heads": f"{a}.attention.head_count_kv", "head_dim": f"{a}.attention.key_length",
                "intermediate_size": f"{a}.feed_forward_length", "max_position_embeddings": f"{a}.context_length",
                "rms_norm_eps": f"{a}.attention.layer_norm_rms_epsilon", "rope_theta": f"{a}.rope.freq_base",
                "rope_scaling.factor": f"{a}.rope.scaling.factor"}

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape under its Hugging Face name, [out, in] (the reverse of the file's order); a layer's
        tensors of kinds kvchat does not read keep a name of their own, so that they still count as a layer."""
        top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
        modules = {v: k for k, v in _LAYER_NAMES.items()}
        out = {}
        for name, t in self.tensors.items():
            parts = name.split(".")
            if name in top:
                out[top[name]] = tuple(reversed(t.shape))
            elif len(parts) == 4 and parts[0] == "blk":
                out[f"model.layers.{parts[1]}.{modules.get(parts[2], '?' + parts[2])}.{parts[3]}"] = tuple(reversed(t.shape))
        return out

    def rope_factors(self) -> tuple[float, ...] | None:
        """Llama 3.x GGUFs store their rope scaling as per-frequency divisors (rope_freqs.weight)."""
        t = self.tensors.get("rope_freqs.weight")
        return tuple(float(v) for v in np.asarray(t.data, dtype=np.float32)) if t is not None else None

    def gguf_name(self, hf_name: str) -> str:
        if hf_name == "model.embed_tokens.weight":
            return "token_embd.weight"
        if hf_name == "model.norm.weight":
            return "output_norm.weight"
        if hf_name == "lm_head.weight":
            return "output.weight"
        _, _, i, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{i}.{_LAYER_NAMES[module]}.{kind}"

    def has(self, hf_name: str) -> bool:
        return self.gguf_name(hf_name) in self.tensors

    def raw(self, hf_name: str):
        """The tensor as stored: (type name, array [rows, bytes or elements per row])."""
        t = self.tensors.get(self.gguf_name(hf_name))
        if t is None:
            raise ModelLoadError(f"{self.path.name} lacks tensor {self.gguf_name(hf_name)} ({hf_name}): the file is "
                                 f"incomplete or not a Llama-family model")
        return t.type_name, t.data

    def dequantize(self, hf_name: str) -> np.ndarray:
        """float32 [rows, cols], by gguf's own dequantize."""
        kind, data = self.raw(hf_name)
        if kind in ("F32", "F16"):            # norms and the like: no need to import gguf for them
            return np.asarray(data, dtype=np.float32)
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        try:
            if kind == "BF16":
                return (data.astype(np.uint32) << 16).view(np.float32)
            return np.asarray(dequantize(data, GGMLQuantizationType[kind]), dtype=np.float32)
        except NotImplementedError as exc:
            raise ModelLoadError(f"{self.path.name}: tensor type {kind} is not supported: re-quantize the model to "
                                 f"Q4_K_M, Q8_0 or F16") from exc

    def release_pages(self, hf_name: str | None = None) -> None:
        """Drop the file's pages (one tensor's, or all) from this process's resident set.

        They stay in the page cache, so a later read costs no disk access; a load releases each
        tensor once it is packed, so the file never sits in memory beside its packed copy.
        """
        if hf_name is None:
            return self.release_range(0, len(self._map))
        t = self.tensors.get(self.gguf_name(hf_name))
        if t is not None:
            self.release_range(t.offset, t.n_bytes)

    def release_range(self, start: int, length: int) -> None:
        """Drop the pages of bytes [start, start + length) of the file from the resident set."""
        mm = getattr(self._map, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise"):
            return
        end = min(len(mm), start + length)
        start = start // mmap.PAGESIZE * mmap.PAGESIZE
        length = end - start
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, length)
        except (OSError, ValueError):
            pass


def q4_blocks(kind: str, data: np.ndarray) -> tuple[np.ndarray, dict]:
    """4-bit blocks as packed codes [N, K/2] uint8 (Q4_0's nibble order) and their scales.

    The value of code q is q * scale + zero: exactly the file's value, never re-rounded. The scales
    come as keyword arguments of kernels.cpu_quant.Scales: float [N, K/32] scale and zero, or for
    Q4_K its 6-bit codes with the float d and -dmin of each super-block of 8 groups.
    """
    n = data.shape[0]
    if kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        heads, codes = split_blocks(data, size, size - 16)
        # the file's float16 scales as they are (float32 only where -8 * d of Q4_0 leaves float16's range)
        d = _f16(heads[..., 0:2], np.float16)
        # Q4_0: w = d * (q - 8); Q4_1: w = d * q + m
        if kind == "Q4_0":
            wide = d.astype(np.float32)
            zero = wide * -8                       # exact: a power of two
            if np.abs(zero).max(initial=0) <= 65504:
                zero = zero.astype(np.float16)     # within float16's range: exact there too
            else:
                d = wide
        else:
            zero = _f16(heads[..., 2:4], np.float16)
        return codes.reshape(n, -1), {"scale": d, "zero": zero}
    if kind == "Q4_K":
        blocks = data.reshape(n, -1, 144)                                     # super-blocks of 256
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        sc, mn = _k_scale_min(blocks[..., 4:16])                              # [N, S, 8] each
        qs = blocks[..., 16:].reshape(n, -1, 4, 32)                           # 4 chunks of 64 values
        codes = np.stack((qs & 0x0F, qs >> 4), 3)                             # [N, S, 4, 2, 32]: groups of 32
        g = codes.reshape(n, -1, 2, 16)                                       # repack: j low, j + 16 high
        packed = g[:, :, 0] | (g[:, :, 1] << 4)
        return packed.reshape(n, -1), {"scale": sc.astype(np.uint8).reshape(n, -1), "scale_sup": d,
                                       "zero": mn.astype(np.uint8).reshape(n, -1), "zero_sup": -dmin, "per": 8}
    raise ValueError(kind)


INT8_GRID_TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K")


def q8_grid(kind: str, data: np.ndarray) -> tuple[dict, int]:
    """Scales of the 5-8 bit types from their block headers (Scales keyword arguments) and the group size."""
    n = data.shape[0]
    if kind == "Q8_0":
        return {"scale": _f16(data.reshape(n, -1, 34)[..., 0:2])}, 32
    if kind == "Q5_0":
        return {"scale": _f16(data.reshape(n, -1, 22)[..., 0:2])}, 32
    if kind == "Q5_1":
        b = data.reshape(n, -1, 24)
        return {"scale": _f16(b[..., 0:2]), "zero": _f16(b[..., 2:4])}, 32
    if kind == "Q5_K":
        b = data.reshape(n, -1, 176)
        sc, mn = _k_scale_min(b[..., 4:16])
        return {"scale": sc.astype(np.uint8).reshape(n, -1), "scale_sup": _f16(b[..., 0:2]),
                "zero": mn.astype(np.uint8).reshape(n, -1), "zero_sup": -_f16(b[..., 2:4]), "per": 8}, 32
    if kind == "Q6_K":
        b = data.reshape(n, -1, 210)
        return {"scale": np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(n, -1),
                "scale_sup": _f16(b[..., 208:210]), "per": 16}, 16
    raise ValueError(kind)


def dense_scales(grid: dict) -> tuple[np.ndarray, np.ndarray | None]:
    """float32 [N, G] scale and zero of a grid from q8_grid / q4_blocks, computed as gguf computes them."""
    def widen(q, sup):
        if q is None or sup is None:
            return q
        return (np.repeat(sup, grid.get("per", 1), axis=-1) * q.astype(np.float32)).astype(np.float32)
    return widen(grid["scale"], grid.get("scale_sup")), widen(grid.get("zero"), grid.get("zero_sup"))


def split_blocks(data: np.ndarray, size: int, head: int, heads: np.ndarray | None = None,
                 body: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Rows of blocks of `size` bytes [N, nb * size] -> each block's first `head` bytes [N, nb, head] (the scales)
    and the rest [N, nb * (size - head)] (the codes), into heads / body when given. The C kernels' split_blocks
    where they load (a few GB/s), else numpy's strided copies (1-2 GB/s)."""
    n = data.shape[0]
    nb = data.shape[1] // size
    heads = np.empty((n, nb, head), dtype=np.uint8) if heads is None else heads.reshape(n, nb, head)
    body = np.empty((n, nb * (size - head)), dtype=np.uint8) if body is None else body.reshape(n, nb * (size - head))
    from kernels import cpu_lib
    lib = cpu_lib.library()
    src = data if data.flags.c_contiguous else None
    if lib is not None and src is not None and heads.flags.c_contiguous and body.flags.c_contiguous:
        lib.split_blocks(src.ctypes.data, n * nb, size, head, heads.ctypes.data, body.ctypes.data)
    else:
        blocks = data.reshape(n, nb, size)
        heads[...] = blocks[..., :head]
        body[...] = blocks[..., head:].reshape(n, -1)
    return heads, body


def _f16(b: np.ndarray, dtype=np.float32) -> np.ndarray:
    # [..., 2] bytes -> [...] float32 (or float16, as stored)
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(dtype)


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # s: [..., 12] bytes holding eight 6-bit scales and eight 6-bit mins (the K-quant packing)
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate((a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)), -1)
    mn = np.concatenate((b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)), -1)
    return sc.astype(np.float32), mn.astype(np.float32)


def unpermute_rows(x: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (pairs interleaved) back to the Hugging Face half-split order."""
    n = x.shape[0]
    return x.reshape(num_heads, n // num_heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _string(buf, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8", errors="replace"), pos + 8 + n


class SkippedArray:
    """A metadata array not parsed (the vocabulary, merges): its length, and where it lies for GGUFFile.array."""

    def __init__(self, n: int, offset: int = -1, item_type: int = -1):
        self.n, self.offset, self.item_type = n, offset, item_type

    def __len__(self) -> int:
        return self.n


def _value(buf, pos: int, vtype: int):
    if vtype == _STRING:
        return _string(buf, pos)
    if vtype == _ARRAY:
        itype, n = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if itype == _STRING:
            start = pos
            for _ in range(n):           # skip: length-prefixed strings
                (m,) = struct.unpack_from("<Q", buf, pos)
                pos += 8 + m
            return SkippedArray(n, start, itype), pos
        if itype == _ARRAY:
            raise ValueError("nested metadata arrays are not supported")
        dt = np.dtype(_SCALAR[itype])
        values = np.frombuffer(buf, dtype=dt, count=n, offset=pos) if n <= 4096 else SkippedArray(n, pos, itype)
        return (values.tolist() if isinstance(values, np.ndarray) else values), pos + n * dt.itemsize
    dt = np.dtype(_SCALAR[vtype])
    value = np.frombuffer(buf, dtype=dt, count=1, offset=pos)[0].item()
    return (bool(value) if vtype == 7 else value), pos + dt.itemsize


def q8_rows(gf: "GGUFFile", name: str, chunk: int = 2048):
    """Codes [N, K] int8 and the file's own scales (and zeros) of a 5-8 bit tensor, a chunk of rows at a time.

    Each value the file holds is code * scale + zero exactly, so the codes are recovered by
    rounding (value - zero) / scale of gguf's own dequantization: nothing is re-quantized.
    """
    kind, data = gf.raw(name)
    t = gf.tensors[gf.gguf_name(name)]
    n, k = data.shape[0], t.shape[0]
    if kind == "Q8_0":
        # the codes are the blocks' bytes after their scale: copied a chunk of rows at a time, each
        # chunk's file pages released at once, so a large table never sits in memory twice
        codes, scale = np.empty((n, k), dtype=np.int8), np.empty((n, k // 32), dtype=np.float16)   # scales as stored
        row_bytes = data.shape[1]
        for lo in range(0, n, chunk):
            rows = data[lo:lo + chunk]
            split_blocks(rows, 34, 2, scale[lo:lo + chunk].view(np.uint8), codes[lo:lo + chunk].view(np.uint8))
            gf.release_range(t.offset + lo * row_bytes, rows.shape[0] * row_bytes)
        return codes, {"scale": scale}
    from gguf import GGMLQuantizationType     # the other types are dequantized by gguf itself
    from gguf.quants import dequantize
    qtype = GGMLQuantizationType[kind]
    grid, group = q8_grid(kind, data)
    scale, zero = dense_scales(grid)
    codes = np.empty((n, k), dtype=np.int8)
    for lo in range(0, n, chunk):
        w = np.asarray(dequantize(data[lo:lo + chunk], qtype), dtype=np.float32).reshape(-1, k // group, group)
        if zero is not None:
            w = w - zero[lo:lo + chunk, :, None]
        s = scale[lo:lo + chunk, :, None]
        q = np.divide(w, s, out=np.zeros_like(w), where=s != 0)
        codes[lo:lo + chunk] = np.rint(q).reshape(-1, k)
    return codes, grid
