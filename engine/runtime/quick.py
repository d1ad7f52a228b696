"""A one-shot answer in the terminal (`kvchat chat --prompt`) without torch.

`import torch` alone takes about 2 s and 190 MiB here, longer than the rest of a one-shot answer of the
default model. A GGUF whose every decoder layer the C kernels cover (packed 4-, 6- or 8-bit blocks, no
biases) is answered here from numpy arrays instead: the same file read in place, the same tokenizer and
chat template, and every token through the kernel the engine's own decode steps run
(kernels/cpu_quant.c: decode_layers, then the output head's gemv). The prompt goes through that kernel
too, up to 64 tokens a call, one pseudo-sequence per token whose rows end at its own: causal by rows.

The cache is one bf16 page per layer (the engine's default cache on the CPU), sized for the prompt and
the reply. Whatever this path does not cover (another device, cache settings, a seeded sample, which
must equal the engine's own stream, 16-bit or 2-3 bit weights, biases) answers None before anything is
printed, and the CLI runs the engine as before.
"""
from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvchat.kernels import cpu_lib

from kvchat.engine.config import CacheConfig, EngineConfig, SamplingParams, SpeculativeConfig
from kvchat.engine.errors import ModelLoadError
from kvchat.engine.gguf.blocks import packed_matrix
from kvchat.engine.model.gguf_view import GGUFModel
from kvchat.engine.model.config import ModelConfig, layer_modules
from kvchat.engine.model.source import locate
from kvchat.engine.model.spec import rope_cos_sin_numpy
from kvchat.engine.plan.fit import check_fits
from kvchat.engine.runtime.sampling import sample_numpy
from kvchat.engine.text.chat_format import chat_format_notice, clean_text, encode_conversation, stop_ids, tokenize_pieces
from kvchat.engine.text.detok import StreamDecoder
from kvchat.engine.text.reasoning import PLAIN
from kvchat.engine.text.reply import reply_format
from kvchat.engine.text.tokenizer_cache import gguf_tokenizer

CHUNK = 64                 # prompt tokens a kernel call


class NotCovered(Exception):
    """This model or request needs the engine."""


def _ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


@dataclass
class Packed:
    """One stored matrix in the kernels' packed form (as linears.Q4Linear / Q5Linear / Q6Linear / Q8Linear hold it),
    numpy arrays."""
    bits: int
    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None
    scale_sup: np.ndarray | None
    zero_sup: np.ndarray | None
    per: int
    offset8: bool = False            # Q4_0 (Q5_0): zero = -8 (-16) * scale, not stored (cpu_quant.Scales.offset8)
    high: np.ndarray | None = None   # bits 6 (Q6_K): the high 2 bits of the codes (kernels/cpu_q6k.h); bits 5: the
                                     # fifth bits (the q4 kernels' high)
    kpacked: bool = False            # Q4_K / Q5_K's own scale bytes (cpu_quant.Scales.kpacked): zero is scale

    @property
    def kind(self) -> int:
        # cpu_quant.Scales.kind, with Q4_0's zero left implicit as Scales.implicit_zero does
        if self.kpacked:
            return 5
        if self.scale_sup is not None:
            return 2 if self.scale.dtype == np.uint8 else 3
        if self.scale.dtype == np.float16:
            return 4 if self.zero is None and self.bits in (4, 5) and self.offset8 else 1
        return 0

    @property
    def n(self) -> int:
        return self.codes.shape[0]

    @property
    def k(self) -> int:
        return self.codes.shape[1] * (1 if self.bits == 8 else 2)

    @property
    def group(self) -> int:
        """Elements per scale: 32, or 16 for Q6_K."""
        return self.k // self.scale.shape[1] if self.bits not in (4, 5) else 32

    def qlin(self, lo: int = 0, hi: int | None = None) -> cpu_lib.QLin:
        """Rows lo..hi (all by default) as the kernels' linear: pointers into the same arrays (an expert of a 3-D
        expert tensor is a run of its rows)."""
        hi = self.n if hi is None else hi

        def at(a):
            return None if a is None else a.ctypes.data + lo * a.strides[0]
        zero = self.high if self.bits == 6 else self.zero      # Q6_K: the high bits ride in the zero field
        five = self.bits == 5                                   # q5: the q4 kernels with the fifth bits
        return cpu_lib.QLin(at(self.codes), at(self.scale), at(zero), at(self.scale_sup), at(self.zero_sup),
                            4 if five else self.bits, self.kind, self.per, self.group, hi - lo, self.k, 0,
                            at(self.high) if five else None)

    def rows(self, lib, ids: list[int]) -> np.ndarray:
        """Dequantized rows [len(ids), K] float32 (the embedding lookup), by the kernels' exact dequantization."""
        out = np.empty((len(ids), self.k), dtype=np.float32)
        for i, r in enumerate(ids):
            if not 0 <= r < self.n:
                raise ValueError(f"token id {r} is past the table's {self.n} rows")
            row = [None if a is None else np.ascontiguousarray(a[r:r + 1])      # held until the call returns
                   for a in (self.codes, self.scale, self.zero, self.scale_sup, self.zero_sup, self.high)]
            c, s, z, ss, zs, h = map(_ptr, row)
            if self.bits == 6:
                lib.q6k_dequant(c, h, s, ss, 1, self.k, _ptr(out[i:i + 1]))
            elif self.bits in (4, 5):
                lib.q4_dequant(c, s, z, 1, self.k, _ptr(out[i:i + 1]), self.kind, ss, zs, self.per,
                               h if self.bits == 5 else None)
            else:
                lib.q8_dequant(c, s, z, self.group, 1, self.k, _ptr(out[i:i + 1]), self.kind, ss, zs, self.per)
        return out


def _pack(gf: GGUFModel, name: str, heads: int | None) -> Packed:
    """The file's blocks as the engine packs them (gguf.blocks.packed_matrix), with cpu_quant.Scales' choice of
    scale storage made over numpy (Q4Linear / Q8Linear make it over torch: linears._compact)."""
    m = packed_matrix(gf, name, heads)
    if m is None:
        raise NotCovered(f"{name} is {gf.raw(name)[0]}")
    bits, arrays = m.bits, m.grid
    scale, zero = arrays["scale"], arrays.get("zero")
    sup = arrays.get("scale_sup")
    offset8 = False
    if sup is None:
        if scale.dtype != np.float16 or (zero is not None and zero.dtype != np.float16):
            scale = scale.astype(np.float32)
            zero = None if zero is None else zero.astype(np.float32)
        elif bits in (4, 5) and zero is not None and np.array_equal(zero.astype(np.float32),
                                                                    scale.astype(np.float32) * (-8 if bits == 4 else -16)):
            zero, offset8 = None, True          # Q4_0 (Q5_0): zero = -8 (-16) * scale, not stored
    kpacked = bool(arrays.get("kpacked"))
    return Packed(bits, m.codes, scale, scale if kpacked else zero, sup, arrays.get("zero_sup"),
                  int(arrays.get("per", 1)), offset8, arrays.get("high"), kpacked)


class QuickModel:
    """A GGUF's decoder layers as decode_layers' table over numpy arrays, its embedding and head."""

    def __init__(self, path: Path):
        self.gf = gf = GGUFModel(path)
        c = ModelConfig.from_gguf(gf)
        if c.longrope:      # the factors the engine takes for this path's cache, the default (its arithmetic has torch)
            from kvchat.engine.kv.layout import cache_context
            c = c.for_context(cache_context(c, CacheConfig(), "fp32", "cpu"))
        self.config = c
        check_fits(c, gf.tensor_bytes, "auto", "cpu", path.name)      # too big: the engine refuses, with the numbers
        if not c.one_table_ok:              # the engine's one-call step's rule, the Llama layer's (ModelConfig.one_table_ok)
            raise NotCovered(f"{c.model_type}: layers decode_layers does not compute")
        if c.head_dim > 256:
            raise NotCovered(f"head_dim {c.head_dim}: decode_attend holds at most 256")
        self.lib = cpu_lib.library()
        if self.lib is None:
            raise NotCovered(cpu_lib.library_error())
        self.keep = []                       # every array the table points into
        table = (cpu_lib.QLayer * c.num_layers)()
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            modules = layer_modules(c, c.layers[i])       # the family's names (Phi-3: qkv and gate | up stored fused)
            ex = c.layers[i].experts
            slots = [modules[part] for part in (("qkv", "o", "gate_up", "down") if ex is None else ("qkv", "o"))]
            for s, names in enumerate(slots):
                parts = []
                for m in names:
                    name = p + m + ".weight"
                    parts.append(_pack(gf, name, gf.permuted_heads(name, c.num_heads, c.num_kv_heads)))
                    gf.release_pages(p + m + ".weight")      # the packed copy stays, the file's pages go
                self.keep += parts
                table[i].nparts[s] = len(parts)
                for j, part in enumerate(parts):
                    table[i].lin[s][j] = part.qlin()
            if ex is not None:
                table[i].moe = ctypes.addressof(self._experts(p, ex))
            norms = [self._vector(p + modules[part][0] + ".weight") for part in ("norm_attn", "norm_mlp")]
            self.keep += norms
            table[i].norm_attn, table[i].norm_mlp = norms[0].ctypes.data, norms[1].ctypes.data
            if "q_norm" in modules:                       # Qwen3: each q and k head RMS-normed before RoPE
                qk = [self._vector(p + modules[part][0] + ".weight") for part in ("q_norm", "k_norm")]
                self.keep += qk
                table[i].q_norm, table[i].k_norm = qk[0].ctypes.data, qk[1].ctypes.data
        self.table = table
        self.embed = _pack(gf, "model.embed_tokens.weight", None)
        tied = c.tie_word_embeddings or not gf.has("lm_head.weight")
        self.head = self.embed if tied else _pack(gf, "lm_head.weight", None)
        self.norm = self._vector("model.norm.weight")
        self.inv_freq = c.rope_frequencies()           # every layer's (one_table_ok)
        self.query_scale = c.layers[0].query_scale

    def _vector(self, name: str) -> np.ndarray:
        return np.ascontiguousarray(self.gf.dequantize(name), dtype=np.float32).reshape(-1)

    def _experts(self, p: str, ex) -> cpu_lib.MoE:
        """A routed layer's router and experts as moe_t (kernels/cpu_moe.h): each expert a run of rows of the 3-D
        tensor's packed form (or its own tensor, in Mixtral's older files); the router packed or float32."""
        gf = self.gf
        if ex.router_bias or ex.expert_bias:
            raise NotCovered("experts with biases")
        name = p + "mlp.router.weight"
        kind, _ = gf.raw(name)
        if kind == "F32":
            w = self._vector(name).reshape(ex.count, -1)
            router = cpu_lib.QLin(w.ctypes.data, None, None, None, None, 32, 0, 1, 32, w.shape[0], w.shape[1])
            self.keep.append(w)
        else:
            packed = _pack(gf, name, None)
            router = packed.qlin()
            self.keep.append(packed)
        arrays = []
        for module in ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj"):
            name = p + module + ".weight"
            names = gf.expert_names(name)
            if names is None:
                packed = _pack(gf, name, None)
                rows = packed.n // ex.count
                parts = [packed.qlin(e * rows, (e + 1) * rows) for e in range(ex.count)]
                self.keep.append(packed)
            else:
                each = [_pack(gf, n, None) for n in names]
                parts = [q.qlin() for q in each]
                self.keep += each
            arrays.append((cpu_lib.QLin * ex.count)(*parts))
            for n in names or [name]:
                gf.release_pages(n)
        self.keep += arrays
        moe = cpu_lib.MoE(ex.count, ex.used, int(ex.activation == "swiglu_oai"), int(ex.normalize), ex.alpha,
                          ex.limit, router, None, *(ctypes.addressof(a) for a in arrays), None, None, None, None)
        self.keep.append(moe)
        return moe

    def rope(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin [N, D] float32 (rotate-half layout), angles in float64: the engine's RoPE table."""
        return rope_cos_sin_numpy(positions, self.inv_freq)


class QuickSequence:
    """One conversation's cache (bf16 pages, one per layer) and its steps through the kernels."""

    def __init__(self, model: QuickModel, capacity: int):
        c = model.config
        self.model, self.length, self.capacity = model, 0, capacity
        shape = (capacity, c.num_kv_heads, c.head_dim)
        self.k = [np.zeros(shape, dtype=np.uint16) for _ in range(c.num_layers)]    # bf16 bits
        self.v = [np.zeros(shape, dtype=np.uint16) for _ in range(c.num_layers)]
        n = c.num_layers
        self._kp = (ctypes.c_void_p * n)(*[a.ctypes.data for a in self.k])
        self._vp = (ctypes.c_void_p * n)(*[a.ctypes.data for a in self.v])
        self._bf16 = (ctypes.c_int * n)(*([1] * n))

    def forward(self, ids: list[int]) -> np.ndarray:
        """Append ids (at most CHUNK) and return the last one's logits [vocab] float32."""
        m, c = self.model, self.model.config
        b, p0 = len(ids), self.length
        assert 0 < b <= CHUNK and p0 + b <= self.capacity
        x = np.ascontiguousarray(m.embed.rows(m.lib, ids))
        pos = np.arange(p0, p0 + b, dtype=np.int64)
        cos, sin = m.rope(pos)
        rows = np.concatenate([np.arange(0, q + 1, dtype=np.int64) for q in pos])
        off = np.zeros(b + 1, dtype=np.int64)
        off[1:] = np.cumsum(pos + 1)
        n_sink = np.zeros(b, dtype=np.int32)
        rc = m.lib.decode_layers(c.num_layers, ctypes.addressof(m.table), b, _ptr(x), c.hidden_size,
                                 float(c.rms_norm_eps), c.num_heads, c.num_kv_heads, c.head_dim, self._kp, self._vp,
                                 self._bf16, _ptr(cos), _ptr(sin), None, None, _ptr(n_sink), _ptr(pos), _ptr(rows),
                                 _ptr(off), float(m.query_scale), None, None, None, 0, None)
        if rc == -3:       # the widths did not chain: check_weight_shapes should have refused the file first
            raise ValueError("decode_layers: the layer table's widths do not match the model's")
        if rc:
            raise MemoryError("decode_layers: out of memory for the step's buffers")
        self.length += b
        last = np.ascontiguousarray(x[-1:])
        h = m.head
        logits = np.empty((1, h.n), dtype=np.float32)
        scratch = np.empty(h.k * 7 + 1024, dtype=np.uint8)
        args = (_ptr(last), 1, h.k, _ptr(h.codes), _ptr(h.scale), _ptr(h.zero))
        tail = (_ptr(logits), _ptr(scratch), 1, _ptr(m.norm), float(c.rms_norm_eps), None, h.kind,
                _ptr(h.scale_sup), _ptr(h.zero_sup), h.per)
        if h.bits == 6:
            m.lib.q6k_gemv(_ptr(last), 1, h.k, _ptr(h.codes), _ptr(h.high), _ptr(h.scale), _ptr(h.scale_sup), h.n,
                           *tail[:6])
        elif h.bits in (4, 5):
            m.lib.q4_gemv(*args, h.n, *tail, _ptr(h.high) if h.bits == 5 else None)
        else:
            m.lib.q8_gemv(*args, h.group, h.n, *tail)
        return logits[0]


def covers(args) -> bool:
    """Whether `kvchat chat --prompt` with these arguments may try this path: a CPU run with the default
    cache and weights, no seed (a seeded sample must equal the engine's own stream), and no --json."""
    cache = CacheConfig()             # the command line's defaults are these (cli/options.py)
    defaults = dict(dtype=EngineConfig().dtype, k_format=cache.k_format, v_format=cache.v_format,
                    k_scheme=cache.k_scheme, window=cache.window, sinks=cache.sinks, block_size=cache.block_size,
                    budget_mb=cache.budget_mb, overflow=cache.overflow, eviction=cache.eviction,
                    retrieval_blocks=cache.retrieval_blocks, fp_layers=",".join(map(str, cache.full_precision_layers)))
    # the one-shot path decodes plainly (the same tokens greedy); asking for something else takes the engine's
    defaults.update(speculative=SpeculativeConfig().method, spec_tokens=SpeculativeConfig().k, draft_model=None)
    if os.environ.get("KVCHAT_NO_QUICK") or args.prompt is None or getattr(args, "json", False):
        return False
    # this path reads the prompt through the decode kernel, as exact as the fp32 GEMM: asked for bf16, it declines
    if getattr(args, "prefill", "auto") in ("bf16", "int8") or getattr(args, "activations", "int16") != "int16":
        return False
    if any(getattr(args, k, v) != v for k, v in defaults.items()):
        return False
    if args.seed is not None and args.temperature > 0:
        return False
    cuda = Path("/dev/nvidiactl").exists() or bool(os.environ.get("CUDA_VISIBLE_DEVICES"))
    return args.device == "cpu" or (args.device == "auto" and not cuda)


def one_shot(model: str, prompt: str, system: str | None, params: SamplingParams, out=None) -> int | None:
    """Print the reply to one message as it is generated; 0 when done, None (nothing printed) when this path
    does not cover the model (see the module's docstring)."""
    out = out or sys.stdout
    try:
        files = locate(model)
    except ModelLoadError:
        return None                  # the engine says what is wrong, in its own words
    if not files.is_gguf:
        return None
    try:
        m = QuickModel(files.path)
        tokenizer = gguf_tokenizer(files.path)      # cached after the first start: a tenth of a second
    except (NotCovered, ModelLoadError):
        return None
    if reply_format(tokenizer) is not PLAIN:    # reasoning apart (gpt-oss): the engine's path prints it marked
        return None
    _, pieces = encode_conversation(tokenizer, clean_text(system) if system else system,
                                    [{"role": "user", "content": clean_text(prompt)}])
    ids = tokenize_pieces(tokenizer, pieces)
    limit = m.config.max_position_embeddings
    if not ids or len(ids) >= limit:
        return None
    notice = chat_format_notice(tokenizer, files.path.name)
    if notice:                       # as the engine's path says it (cli/terminal.py), once, on stderr
        print(f"kvchat: {notice}", file=sys.stderr)
    seq = QuickSequence(m, min(limit, len(ids) + params.max_new_tokens))
    for lo in range(0, len(ids), CHUNK):
        logits = seq.forward(ids[lo:lo + CHUNK])
    stops = stop_ids(tokenizer)
    rng = np.random.default_rng(params.seed)
    stream = StreamDecoder(tokenizer)
    held = list(ids)
    for step in range(params.max_new_tokens):
        nxt = sample_numpy(logits, params, held[-1024:], rng)
        held.append(nxt)
        if nxt in stops:
            break
        delta = stream.push(nxt)
        if delta:
            out.write(delta)
            out.flush()
        if step + 1 == params.max_new_tokens or seq.length >= seq.capacity:
            break
        logits = seq.forward([nxt])
    out.write(stream.flush() + "\n")
    out.flush()
    return 0
