"""A GGUF file read in place: metadata, architecture numbers and its tensors as stored.

Nothing here converts the file: it is memory-mapped; engine/gguf/blocks.py reads the quantized blocks
into the kernels' grids, and types without one are dequantized by `gguf` itself.
"""
from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path

import numpy as np

from kvchat.engine.errors import ModelLoadError
from kvchat.engine.gguf import arch as arch_fields
from kvchat.engine.model.families import gguf_family, supported


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
        # the architecture is known (or refused) before any tensor is looked at
        self.arch = self.field("general.architecture")
        self.family = gguf_family(str(self.arch), self.path.name)
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
        self.data_start = start           # the header and tensor index end here (a saved KV cache names their hash)
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
            "model_type": self.family.model_types[0],
            "vocab_size": int(embd.shape[1]),
            "hidden_size": self.field(f"{a}.embedding_length"),
            "num_hidden_layers": self.field(f"{a}.block_count"),
            "num_attention_heads": self.field(f"{a}.attention.head_count"),
            "num_key_value_heads": self.fields.get(f"{a}.attention.head_count_kv"),
            "head_dim": head_dim,                 # absent: hidden_size // heads, as config.json's default
            "intermediate_size": self.fields.get(f"{a}.feed_forward_length") or self.field(
                f"{a}.expert_feed_forward_length" if f"{a}.expert_count" in self.fields else f"{a}.feed_forward_length"),
            "rms_norm_eps": self.fields.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self.fields.get(f"{a}.rope.freq_base", 10000.0),
            "max_position_embeddings": self.fields.get(f"{a}.context_length", 4096),
            "tie_word_embeddings": "output.weight" not in self.tensors,
        }
        kind = self.field(f"{a}.rope.scaling.type", "none")
        if kind == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": self.field(f"{a}.rope.scaling.factor")}
        elif kind == "yarn" and a == "gpt-oss":       # read with the family's fields (arch.py)
            pass
        elif kind not in ("none", ""):
            raise ModelLoadError(f"{self.path.name}: unsupported rope scaling {kind!r}: kvchat supports none and linear")
        cfg.update(arch_fields.family_config(self, cfg))
        return cfg

    def key_names(self) -> dict[str, str]:
        """hf_config's keys -> the header's own, for messages."""
        a = self.arch
        return {"vocab_size": "token_embd.weight's rows", "hidden_size": f"{a}.embedding_length",
                "num_hidden_layers": f"{a}.block_count", "num_attention_heads": f"{a}.attention.head_count",
                "num_key_value_heads": f"{a}.attention.head_count_kv", "head_dim": f"{a}.attention.key_length",
                "intermediate_size": f"{a}.feed_forward_length", "max_position_embeddings": f"{a}.context_length",
                "rms_norm_eps": f"{a}.attention.layer_norm_rms_epsilon", "rope_theta": f"{a}.rope.freq_base",
                "rope_scaling.factor": f"{a}.rope.scaling.factor", **arch_fields.key_names(a)}

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape under its Hugging Face name, [out, in] (the reverse of the file's order); a layer's
        tensors of kinds kvchat does not read keep a name of their own, so that they still count as a layer."""
        top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
        modules = {v: k for k, v in self.family.gguf_tensors.items()}
        out = {}
        per_expert: dict[str, list] = {}
        for name, t in self.tensors.items():
            parts = name.split(".")
            if name in top:
                out[top[name]] = tuple(reversed(t.shape))
            elif len(parts) == 4 and parts[0] == "blk":
                out[f"model.layers.{parts[1]}.{modules.get(parts[2], '?' + parts[2])}.{parts[3]}"] = tuple(reversed(t.shape))
            elif len(parts) == 5 and parts[0] == "blk" and parts[2] in arch_fields.PER_EXPERT_TENSORS \
                    and parts[3].isdigit():
                # Mixtral's older files: one 2-D tensor per expert, read as the 3-D module [experts, out, in]
                key = f"model.layers.{parts[1]}.{arch_fields.PER_EXPERT_TENSORS[parts[2]]}.{parts[4]}"
                per_expert.setdefault(key, []).append((int(parts[3]), tuple(reversed(t.shape))))
        for key, experts in per_expert.items():
            shapes = {shape for _, shape in experts}
            ids = sorted(e for e, _ in experts)
            if len(shapes) != 1 or ids != list(range(len(ids))):
                raise ModelLoadError(f"{self.path.name}: the per-expert tensors of {self.gguf_name(key)} disagree in "
                                     f"shape or skip an expert: the file is damaged; re-download or re-convert it")
            out[key] = (len(ids), *shapes.pop())
        return out

    def expert_names(self, hf_name: str) -> list[str] | None:
        """The per-expert 2-D tensors (blk.N.ffn_gate.E.weight) that hold the 3-D module `hf_name` in Mixtral's older
        files, in expert order; None where the file stores it as one 3-D tensor (or not at all)."""
        if self.has(hf_name):
            return None
        _, _, i, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        short = {v: k for k, v in arch_fields.PER_EXPERT_TENSORS.items()}.get(module)
        names = []
        while short is not None and f"blk.{i}.{short}.{len(names)}.{kind}" in self.tensors:
            names.append(f"blk.{i}.{short}.{len(names)}.{kind}")
        return names or None

    def rope_factors(self) -> tuple[float, ...] | None:
        """Llama 3.x GGUFs store their rope scaling as per-frequency divisors (rope_freqs.weight)."""
        t = self.tensors.get("rope_freqs.weight")
        return tuple(float(v) for v in np.asarray(t.data, dtype=np.float32)) if t is not None else None

    def gguf_name(self, hf_name: str) -> str:
        """llama.cpp's name of a tensor kvchat names `hf_name` (a name that is already llama.cpp's passes through)."""
        if hf_name.startswith("blk."):
            return hf_name
        if hf_name == "model.embed_tokens.weight":
            return "token_embd.weight"
        if hf_name == "model.norm.weight":
            return "output_norm.weight"
        if hf_name == "lm_head.weight":
            return "output.weight"
        _, _, i, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{i}.{self.family.gguf_tensors[module]}.{kind}"

    def permuted_heads(self, hf_name: str, num_heads: int, num_kv_heads: int) -> int | None:
        """How many heads' rows llama.cpp's converter interleaved in this tensor (unpermute_rows undoes it):
        q and k of the families it permutes, None for every other tensor."""
        if not self.family.gguf_permuted_qk:
            return None
        for module, heads in (("self_attn.q_proj", num_heads), ("self_attn.k_proj", num_kv_heads)):
            if f".{module}." in hf_name:
                return heads
        return None

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
