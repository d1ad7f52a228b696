"""A conversation's KV cache as a file: its blocks as stored, and what produced them.

The file is safetensors (no pickle). Its tensors: per KV group and layer, the K and V pages of the sequence's
blocks in table order (data, and scales and zero points where the format has them), the full-precision tail and
head of quantized components, and whatever the caller adds (token ids, logits). Its metadata, JSON under
"kvchat", names the format version, the identity of the model, each group's layout, window geometry and counts,
and a checksum of the rest of the file's contents (SHA-256 over the description, the tensors' names and shapes and
each tensor's checksum64 lanes, kernels/cpu_quant.py; a file saved before that holds SHA-256 of every byte, and
still opens).

Written atomically: a temp file in the same folder, fsync, rename, fsync of the folder. Read without trust: only a
regular file, opened without following a link or blocking, its size capped before a byte is read; the checksum is
checked before any tensor is used, every tensor must have exactly the shape and dtype the *current* layout gives
for the counts, so a crafted header can neither make the engine allocate more than the file holds nor index outside
its pages, and every floating value attention reads must be finite (a NaN page would pass any checksum). Anything
wrong is a CacheFileError whose text says why in the user's words; the caller then reads the conversation's text
again.
"""
from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import stat
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from kvchat.engine.kv.layout import KVLayout
from kvchat.kernels import cpu_quant
from kvchat.engine.kv.manager import NoFreeBlocks
from kvchat.engine.kv.pages import Component
from kvchat.engine.kv.sequence import Sequence

FORMAT_VERSION = 1
META_KEY = "kvchat"


class CacheFileError(Exception):
    """A saved cache that cannot be restored; the text says why (the conversation is read again instead)."""


class NoSavedCache(CacheFileError):
    """There is no saved cache for the conversation (nothing is wrong: it was never saved, or it was deleted)."""


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A page tensor as rows of bytes where torch cannot index its dtype on the CPU (fp8), else itself."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def _blocks_of(c: Component, name: str, table: list[int]) -> torch.Tensor:
    ids = torch.tensor(table, dtype=torch.long, device=c.device)
    t = c.pages[name]
    return _rows(t).index_select(0, ids).view(t.dtype).cpu().contiguous()


def group_meta(seq: Sequence) -> dict:
    meta = {"layout": repr(seq.layout), "geometry": repr(seq.geometry), "num_tokens": seq.num_tokens,
            "evicted": seq.evicted, "sink_blocks": seq.sink_blocks, "blocks": len(seq.block_table)}
    if seq.geometry.by_importance:      # the blocks attention let go, wherever they were
        meta["holes"] = [i for i, b in enumerate(seq.table) if b is None]
    return meta


def _holes(meta: dict, num_tokens: int, evicted: int, sink_blocks: int, bs: int) -> list[int] | None:
    """The table positions a group kept by attention let go (checked), or None for one kept by a window."""
    holes = meta.get("holes")
    if holes is None:
        return None
    blocks = -(-num_tokens // bs)
    if (not isinstance(holes, list) or len(holes) != evicted or holes != sorted(set(holes))
            or not all(isinstance(i, int) and not isinstance(i, bool) and sink_blocks <= i < blocks - 2
                       for i in holes)):
        raise CacheFileError("the saved cache's list of dropped blocks is damaged")
    return holes


def export_groups(cache, seq: Sequence) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Every KV group of a conversation: (per group its metadata, the tensors), byte for byte as stored."""
    metas, tensors = [], {}
    for g, m in enumerate(seq.members):
        metas.append(group_meta(m))
        for l, pair in enumerate(cache.components(m.layout)):
            for role, c in zip("kv", pair):
                prefix = f"g{g}.l{l}.{role}."
                if m.block_table:
                    for name in c.pages:
                        tensors[prefix + name] = _blocks_of(c, name, m.block_table)
                tail = c.tails.get(m.seq_id)
                if tail is not None:
                    tensors[prefix + "tail"] = tail.cpu().contiguous()
                head = c.heads.get(m.block_table[0]) if m.block_table else None
                if head is not None:
                    tensors[prefix + "head"] = head.cpu().contiguous()
    return metas, tensors


def _expected(cache, layout: KVLayout, n_blocks: int, g: int) -> dict[str, tuple]:
    """name -> (shape, dtype, required) of every tensor a group of n_blocks blocks may have in this layout."""
    out = {}
    for l, pair in enumerate(cache.components(layout)):
        for role, c in zip("kv", pair):
            prefix = f"g{g}.l{l}.{role}."
            if n_blocks:
                for name, (shape, dtype) in c.shapes.items():
                    out[prefix + name] = ((n_blocks, *shape), dtype, True)
            if c.fmt.is_quantized:
                side = ((c.block_size, c.num_heads, c.head_dim), c.full_dtype, False)
                out[prefix + "tail"] = side
                if n_blocks:
                    out[prefix + "head"] = side
    return out


def _count(meta: dict, key: str) -> int:
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CacheFileError(f"the saved cache's {key} is not a count ({value!r}): the file is damaged")
    return value


def check_groups(cache, members: list[Sequence], metas, tensors: dict, extra: set[str]) -> None:
    """The saved groups fit these (empty) sequences' layouts exactly, every tensor of the shape they give; raises
    CacheFileError. extra: names the caller's own tensors may take."""
    if not isinstance(metas, list) or len(metas) != len(members):
        raise CacheFileError("the saved cache has another number of KV groups than this model in this cache mode")
    allowed: dict[str, tuple] = {}
    read = []
    for g, (m, meta) in enumerate(zip(members, metas)):
        if not isinstance(meta, dict):
            raise CacheFileError("the saved cache's group description is damaged")
        if meta.get("layout") != repr(m.layout):
            raise CacheFileError("the cache was saved in another cache mode or KV layout (format, block size or "
                                 "layers differ)")
        if meta.get("geometry") != repr(m.geometry):
            raise CacheFileError("the cache was saved with another window or number of sinks")
        num_tokens, evicted, sinks, n_blocks = (_count(meta, k) for k in ("num_tokens", "evicted", "sink_blocks",
                                                                          "blocks"))
        bs = m.block_size
        seq_len = num_tokens - evicted * bs
        if (seq_len < 0 or n_blocks != m.layout.blocks_for(seq_len) or sinks not in (0, m.geometry.sink_blocks)
                or m.geometry.num_to_evict(num_tokens, evicted, n_blocks)):
            raise CacheFileError("the saved cache's token and block counts do not agree: the file is damaged")
        if m.geometry.by_importance:
            _holes(meta, num_tokens, evicted, sinks, bs)
        allowed.update(_expected(cache, m.layout, n_blocks, g))
        read.append((g, m.layout, seq_len))
    for name, t in tensors.items():
        if name in extra:
            continue
        want = allowed.get(name)
        if want is None:
            raise CacheFileError(f"the saved cache holds a tensor this layout has no place for ({name[:40]})")
        shape, dtype, _ = want
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise CacheFileError(f"the saved cache's {name} is {tuple(t.shape)} {t.dtype}, not {tuple(shape)} "
                                 f"{dtype}: the file is damaged or from another layout")
    missing = [n for n, (_, _, required) in allowed.items() if required and n not in tensors]
    if missing:
        raise CacheFileError(f"the saved cache lacks {len(missing)} of its page tensors: the file is damaged")
    for g, layout, seq_len in read:
        for name, t in _values_read(cache, layout, g, seq_len, tensors):
            if not _finite(t):
                raise CacheFileError(f"the saved cache's {name} holds values that are not finite (NaN or inf): the "
                                     f"file is damaged")


def _values_read(cache, layout: KVLayout, g: int, seq_len: int, tensors: dict):
    """(name, values) of every floating tensor of one group that attention reads: full-precision pages' first
    seq_len rows; quantized pages' full blocks (block 0 only where no head stands in for it), their head and tail.
    The rest of a block was never written and may hold anything."""
    for l, pair in enumerate(cache.components(layout)):
        for role, c in zip("kv", pair):
            prefix = f"g{g}.l{l}.{role}."
            head, tail = tensors.get(prefix + "head"), tensors.get(prefix + "tail")
            rows = slice(int(head is not None), seq_len // c.block_size)
            for name in c.pages:
                t = tensors.get(prefix + name)
                if t is not None and t.dtype.is_floating_point:
                    yield prefix + name, t[rows] if c.fmt.is_quantized else t.flatten(0, 1)[:seq_len]
            for name, t in (("head", head), ("tail", tail)):
                if t is not None:
                    yield prefix + name, t


def _finite(t: torch.Tensor) -> bool:
    if not t.dtype.is_floating_point:
        return True
    if t.element_size() == 1:          # fp8: isfinite has no CPU kernel for every kind; fp16 holds each exactly
        t = t.to(torch.float16)
    fast = cpu_quant.all_finite(t)     # the exponent bits alone, without a mask the tensor's size
    return fast if fast is not None else bool(torch.isfinite(t).all())


def _run_of(ids: list[int]) -> slice | None:
    """The slice `ids` are, where they are consecutive and ascending."""
    if ids and ids[-1] - ids[0] == len(ids) - 1 and all(b == a + 1 for a, b in zip(ids, ids[1:])):
        return slice(ids[0], ids[-1] + 1)
    return None


def import_groups(cache, members: list[Sequence], metas: list[dict],
                  tensors: dict[str, torch.Tensor], keep: frozenset[int] = frozenset()) -> None:
    """Fill empty sequences (checked by check_groups) with the saved blocks under new block ids: the pool's budget
    applies (idle conversations outside `keep` may be released for room; NoFreeBlocks when even that is too
    little)."""
    keep = {m.seq_id for m in members} | set(keep)
    taken = []
    try:
        for m, meta in zip(members, metas):
            m.sink_blocks = meta["sink_blocks"]
            seq_len = meta["num_tokens"] - meta["evicted"] * m.block_size
            taken.append(cache.reserve_blocks(m, seq_len, keep))
    except NoFreeBlocks:
        for res in reversed(taken):
            cache.rollback(res)
        raise
    for g, (m, meta, res) in enumerate(zip(members, metas, taken)):
        layout = m.layout
        ids = torch.tensor(m.block_table, dtype=torch.long, device=cache.device)
        run = _run_of(m.block_table)
        for l, pair in enumerate(cache.components(layout)):
            for role, c in zip("kv", pair):
                prefix = f"g{g}.l{l}.{role}."
                if m.block_table:
                    for name, t in c.pages.items():
                        src = _rows(tensors[prefix + name].to(c.device))
                        if run is not None:         # consecutive ids (a fresh pool): one plain copy, 1.6x faster
                            _rows(t)[run].copy_(src)
                        else:
                            _rows(t).index_copy_(0, ids, src)
                    c._kernel_static = None
                tail, head = tensors.get(prefix + "tail"), tensors.get(prefix + "head")
                if tail is not None:
                    c.tails[m.seq_id] = tail.to(c.device).clone()
                if head is not None and m.block_table:
                    c.heads[m.block_table[0]] = head.to(c.device).clone()
        cache.adopt(res, meta["num_tokens"], meta["evicted"],
                    _holes(meta, meta["num_tokens"], meta["evicted"], meta["sink_blocks"], m.block_size))


# ---- the file ------------------------------------------------------------------------------------------------

CHECKSUM = "c64"         # the "checksum" entry's kind: SHA-256 over the description, names and shapes and each
                         # tensor's checksum64 lanes (kernels/cpu_quant.py: checksum, 10x SHA-256's speed)


def _digest(meta_json: str, tensors: dict[str, torch.Tensor], kind: str = CHECKSUM) -> str:
    """The file's checksum: kind "c64", or "sha256" (SHA-256 of every byte, as files saved before c64 hold)."""
    h = hashlib.sha256(meta_json.encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        raw = _rows(t.contiguous()).view(torch.uint8).reshape(-1)
        h.update(cpu_quant.checksum(raw) if kind == CHECKSUM else raw.numpy().data)
    return h.hexdigest()


def write(path: Path, meta: dict, tensors: dict[str, torch.Tensor]) -> int:
    """The file at path, replaced atomically; returns its size."""
    from safetensors.torch import save
    meta_json = json.dumps({**meta, "version": FORMAT_VERSION}, sort_keys=True)
    data = save(tensors, {META_KEY: meta_json, "checksum": f"{CHECKSUM}:{_digest(meta_json, tensors)}"})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:            # some platforms cannot fsync a folder; the rename is still atomic
        pass
    return len(data)


def _file_bytes(path: Path, max_bytes: int) -> np.ndarray:
    """The bytes of a regular file at path, at most max_bytes. Opened without following a link and without
    blocking (a FIFO in its place would otherwise hang the whole process in open()), then checked and read on that
    one descriptor, so what was checked is what is read."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise NoSavedCache("no saved cache") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CacheFileError("the saved cache is a link, not a file kvchat wrote") from None
        raise CacheFileError(f"the saved cache cannot be read ({exc.strerror or exc})") from None
    try:
        with os.fdopen(fd, "rb") as f:          # closes fd
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise CacheFileError("the saved cache is not a regular file (a pipe, device or folder is in its "
                                     "place)")
            if st.st_size > max_bytes:
                raise CacheFileError(f"the saved cache is {st.st_size / 2**20:.0f} MiB, more than this budget "
                                     f"could restore")
            # writable anonymous memory in huge pages where the system lends them (a 96 MB read into fresh 4 KiB
            # pages spent 30-240 ms faulting them in, here), not zero-filled first: the tensors are views of it
            # (_tensors); one byte more than the file, to see it grow
            buf = mmap.mmap(-1, st.st_size + 1)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                try:
                    buf.madvise(mmap.MADV_HUGEPAGE)
                except OSError:
                    pass
            data = np.frombuffer(buf, dtype=np.uint8)
            got = _read_parts(f.fileno(), memoryview(buf), st.st_size)
    except OSError as exc:
        raise CacheFileError(f"the saved cache cannot be read ({exc.strerror or exc})") from None
    if got != st.st_size:
        raise CacheFileError("the saved cache changed while it was read")
    return data[:got]


_PART = 16 << 20        # a file past twice this is read in parts, one a thread


def _read_parts(fd: int, buf: memoryview, size: int) -> int:
    """Bytes 0 .. size of fd into buf (one byte longer), in parts read side by side where the file is large (the
    copy out of the page cache is the read's cost: 96 MB in 40 ms on one core, 25 on two); -> bytes read, size + 1
    where the file grew, less where it shrank."""
    if not hasattr(os, "preadv"):          # Windows: one read
        with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
            f.seek(0)
            total = 0
            while total <= size:
                n = f.readinto(buf[total:size + 1])
                if not n:
                    break
                total += n
            return total
    threads = max(1, min(4, torch.get_num_threads(), size // _PART))
    cuts = [size * i // threads // 4096 * 4096 for i in range(threads)] + [size]
    got = [0] * threads

    def part(i: int) -> None:
        lo, hi = cuts[i], cuts[i + 1]
        while lo < hi:
            n = os.preadv(fd, [buf[lo:hi]], lo)
            if n <= 0:
                return
            got[i] += n
            lo += n
    if threads == 1:
        part(0)
    else:                                   # an error in a part is raised here
        with ThreadPoolExecutor(threads, thread_name_prefix="kvchat-read") as pool:
            list(pool.map(part, range(threads)))
    total = sum(got)
    if total == size and os.preadv(fd, [buf[size:size + 1]], size) > 0:     # grew since it was measured
        total += 1
    return total


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _tensors(data) -> tuple[dict, dict[str, torch.Tensor]]:
    """(header, tensors) of a safetensors file's bytes (a writable buffer), the tensors views of `data` (no copy):
    every entry's type, shape and byte range checked, as safetensors' own reader checks them; CacheFileError
    otherwise."""
    bad = CacheFileError("the saved cache is damaged or truncated")
    data = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    if len(data) < 8:
        raise bad
    n = int.from_bytes(data[:8].tobytes(), "little")
    if n > len(data) - 8 or n > 100 * 2**20:
        raise bad
    header = _json(data[8:8 + n].tobytes().decode("utf-8", "replace"), "header")
    if not isinstance(header, dict):
        raise bad
    body, size, tensors = 8 + n, len(data) - 8 - n, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            lo, hi = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad from None
        count = 1
        for d in shape:
            if d < 0:
                raise bad
            count *= d
        if not 0 <= lo <= hi <= size or hi - lo != count * dtype.itemsize:
            raise bad
        if count == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        elif (body + lo) % dtype.itemsize:      # not aligned to its type: a copy (safetensors never writes one)
            tensors[name] = torch.frombuffer(bytearray(data[body + lo:body + hi]), dtype=dtype).clone().view(shape)
        else:
            tensors[name] = torch.frombuffer(data, dtype=dtype, count=count, offset=body + lo).view(shape)
    return header, tensors


def _json(text: str, what: str):
    """Parsed JSON; a damaged or depth-bombed text is a CacheFileError."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise CacheFileError(f"the saved cache's {what} is damaged") from None


def read(path: Path, max_bytes: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata, tensors) of a file written by `write`, checked against its checksum; CacheFileError otherwise."""
    data = _file_bytes(Path(path), max_bytes)
    header, tensors = _tensors(data)
    with_meta = header.get("__metadata__") if isinstance(header, dict) else None
    with_meta = with_meta if isinstance(with_meta, dict) else {}
    del data
    meta_json, checksum, digest = with_meta.get(META_KEY), with_meta.get("checksum"), with_meta.get("sha256")
    kind = "sha256"                 # a file saved before the c64 checksum: SHA-256 over every byte
    if isinstance(checksum, str) and checksum.startswith(CHECKSUM + ":"):
        kind, digest = CHECKSUM, checksum[len(CHECKSUM) + 1:]
    if not isinstance(meta_json, str) or not isinstance(digest, str):
        raise CacheFileError("the file is not a kvchat cache")
    if _digest(meta_json, tensors, kind) != digest:
        raise CacheFileError("the saved cache does not match its checksum: the file is damaged")
    meta = _json(meta_json, "description")
    if not isinstance(meta, dict):
        raise CacheFileError("the saved cache's description is damaged")
    if meta.get("version") != FORMAT_VERSION:
        version = str(meta.get("version"))[:12]
        raise CacheFileError(f"the cache was saved by another version of kvchat (format {version}, this one reads "
                             f"{FORMAT_VERSION})")
    return meta, tensors
