"""A GGUF file read in place: its metadata and its tensors as stored, whatever the architecture.

Nothing here converts the file: it is memory-mapped; engine/gguf/blocks.py reads the quantized blocks
into the kernels' grids, and types without one are dequantized by `gguf` itself. The container knows no
model: an architecture kvchat does not run reads as well as one it does. What the keys and tensors mean for
a model (its family, config.json's fields, Hugging Face tensor names) is engine/model/gguf_view.py's.
"""
from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path

import numpy as np

from kvchat.engine.errors import ModelLoadError


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
        # named, not judged: whether kvchat runs it is the model's question (engine/model/gguf_view.py)
        self.arch = str(self.fields.get("general.architecture") or "")
        self._metadata_read()
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

    def _metadata_read(self) -> None:
        """Called once the metadata is read and before any tensor is: the container reads every architecture, a
        reader that judges one (the model's view) refuses it here, so its message comes before a tensor's."""

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

    def gguf_name(self, name: str) -> str:
        """The file's own name of tensor `name`: the container speaks llama.cpp's names only (a model's view maps
        its own names here, and blocks.py reads through whichever it is given)."""
        return name

    def has(self, name: str) -> bool:
        return self.gguf_name(name) in self.tensors

    def raw(self, name: str):
        """The tensor as stored: (type name, array [rows, bytes or elements per row])."""
        t = self.tensors.get(self.gguf_name(name))
        if t is None:
            own = self.gguf_name(name)
            raise ModelLoadError(f"{self.path.name} lacks tensor {own}{f' ({name})' if own != name else ''}: the file "
                                 f"is incomplete or not a Llama-family model")
        return t.type_name, t.data

    def dequantize(self, name: str) -> np.ndarray:
        """float32 [rows, cols], by gguf's own dequantize."""
        kind, data = self.raw(name)
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

    def release_pages(self, name: str | None = None) -> None:
        """Drop the file's pages (one tensor's, or all) from this process's resident set.

        They stay in the page cache, so a later read costs no disk access; a load releases each
        tensor once it is packed, so the file never sits in memory beside its packed copy.
        """
        if name is None:
            return self.release_range(0, len(self._map))
        t = self.tensors.get(self.gguf_name(name))
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
