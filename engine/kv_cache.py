"""One conversation's paged KV cache: per-layer page tensors, the block table, the window.

Block ids come from a BlockPool and are shared by all layers; each layer keeps its own page
tensors for K and for V, so layers may differ in format. Quantized components keep the block
being filled in full precision (the tail) and quantize it once, when it is full.

Slots: the block table's blocks laid end to end. With a window, the first `num_sink_blocks`
blocks hold the sinks and blocks that leave the window are freed; in-cache positions follow
StreamingLLM (see kernels.reference.slot_positions).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import kernels
from kernels.formats import FULL_DTYPES, PageFormat, bytes_per_block, page_format

from .block_pool import BlockPool
from .config import CacheConfig, ConfigError
from .model import ModelConfig

MIB = 1024 * 1024


class Component:
    """The pages of one layer's K or V: data/scale/zero tensors indexed by block id."""

    def __init__(self, fmt: PageFormat, block_size: int, num_heads: int, head_dim: int, tail_dtype, device):
        self.fmt = fmt
        self.block_size, self.num_heads, self.head_dim = block_size, num_heads, head_dim
        self.shapes = fmt.shapes(block_size, num_heads, head_dim)
        self.pages = {name: torch.empty((0, *shape), dtype=dtype, device=device) for name, (shape, dtype) in self.shapes.items()}
        # the block being filled, full precision, only where the pages are quantized
        # allocated on first write so an empty cache holds no bytes at all
        self.tail: torch.Tensor | None = None
        self.tail_dtype, self.device = tail_dtype, device

    def resize(self, num_blocks: int) -> None:
        for name, t in self.pages.items():
            n = t.shape[0]
            if num_blocks > n:
                grow = torch.zeros((num_blocks - n, *t.shape[1:]), dtype=t.dtype, device=t.device)
                self.pages[name] = torch.cat((t, grow)) if n else grow
            elif num_blocks < n:
                self.pages[name] = t[:num_blocks].clone()

    @property
    def nbytes(self) -> int:
        total = sum(t.numel() * t.element_size() for t in self.pages.values())
        if self.tail is not None:
            total += self.tail.numel() * self.tail.element_size()
        return total

    def tensors(self):
        return self.pages["data"], self.pages.get("scale"), self.pages.get("zero")

    def read_blocks(self, block_ids: torch.Tensor) -> torch.Tensor:
        """[n] block ids -> [n, bs, H, D] float32, dequantized."""
        data, scale, zero = self.tensors()
        return kernels.dequantize(data[block_ids], None if scale is None else scale[block_ids],
                                  None if zero is None else zero[block_ids], self.fmt)

    def write(self, x: torch.Tensor, first_slot: int, table: list[int]) -> None:
        """Write x [T, H, D] at slots first_slot.. of the table (pages or tail, quantizing full blocks)."""
        bs = self.block_size
        T = x.shape[0]
        if not self.fmt.is_quantized:
            slots = torch.arange(first_slot, first_slot + T)
            blocks = torch.tensor(table, dtype=torch.long)[slots // bs]
            flat = self.pages["data"].view(-1, self.num_heads, self.head_dim)
            flat.index_copy_(0, (blocks * bs + slots % bs).to(flat.device), x.to(flat.dtype))
            return
        if self.tail is None:
            self.tail = torch.zeros(bs, self.num_heads, self.head_dim, dtype=self.tail_dtype, device=self.device)
        start = (first_slot // bs) * bs
        filled = first_slot - start
        seq = torch.cat((self.tail[:filled].to(x.dtype), x)) if filled else x
        n_full = seq.shape[0] // bs
        if n_full:
            ids = torch.tensor(table[start // bs:start // bs + n_full], dtype=torch.long, device=x.device)
            src = seq[:n_full * bs].reshape(n_full, bs, self.num_heads, self.head_dim)
            kernels.store_blocks(src, ids, *self.tensors(), self.fmt)
        rest = seq[n_full * bs:]
        self.tail.zero_()
        self.tail[:rest.shape[0]] = rest.to(self.tail.dtype)

    def read_slots(self, table: list[int], seq_len: int, slots: torch.Tensor) -> torch.Tensor:
        """Float32 values [len(slots), H, D] of the chosen slots (< seq_len)."""
        bs = self.block_size
        if not self.fmt.is_quantized:
            blocks = torch.tensor(table, dtype=torch.long)[slots // bs]
            flat = self.pages["data"].view(-1, self.num_heads, self.head_dim)
            return flat.index_select(0, (blocks * bs + slots % bs).to(flat.device)).float()
        n_full = seq_len // bs
        parts = []
        if n_full:
            pages = self.read_blocks(torch.tensor(table[:n_full], dtype=torch.long, device=self.device))
            parts.append(pages.flatten(0, 1))
        if seq_len > n_full * bs:
            parts.append(self.tail[:seq_len - n_full * bs].float())
        return torch.cat(parts).index_select(0, slots.to(self.device))


@dataclass(frozen=True, slots=True)
class Plan:
    """What one forward step over T new tokens needs, shared by every layer."""
    num_new: int
    first_slot: int
    past_slots: torch.Tensor      # [P] valid slots before this step
    past_cos: torch.Tensor        # [P, D]
    past_sin: torch.Tensor
    new_cos: torch.Tensor         # [T, D]
    new_sin: torch.Tensor
    seq_len: int                  # slots before this step
    window_start: int
    num_sinks: int


class KVCache:
    def __init__(self, model: ModelConfig, config: CacheConfig, model_dtype: str, device):
        self.model = model
        self.config = config
        self.model_dtype = model_dtype
        self.device = device
        self.inv_freq = model.inv_freq().to(device)
        self._build(config)

    # ---- layout and budget ------------------------------------------------------------

    def formats_for(self, config: CacheConfig, layer: int) -> tuple[PageFormat, PageFormat]:
        if layer in config.full_precision_layers:
            return page_format(self.model_dtype, "k"), page_format(self.model_dtype, "v")
        return (page_format(config.k_format, "k", config.k_scheme, self.model_dtype),
                page_format(config.v_format, "v", config.k_scheme, self.model_dtype))

    def layout_bytes(self, config: CacheConfig) -> tuple[int, int]:
        """(bytes of one block over all layers, fixed bytes of the full-precision tails) for a config."""
        m = self.model
        per_block = tail = 0
        elem = torch.empty((), dtype=FULL_DTYPES[self.model_dtype]).element_size()
        for layer in range(m.num_layers):
            for fmt in self.formats_for(config, layer):
                per_block += bytes_per_block(fmt, config.block_size, m.num_kv_heads, m.head_dim)
                if fmt.is_quantized:
                    tail += config.block_size * m.num_kv_heads * m.head_dim * elem
        return per_block, tail

    def budget_blocks(self, config: CacheConfig) -> int:
        per_block, tail = self.layout_bytes(config)
        return max(0, int((config.budget_mb * MIB - tail) // per_block))

    def _build(self, config: CacheConfig) -> None:
        m = self.model
        bad = [i for i in config.full_precision_layers if i >= m.num_layers]
        if bad:
            raise ConfigError(f"full_precision_layers {bad} do not exist: the model has layers 0-{m.num_layers - 1}")
        blocks = self.budget_blocks(config)
        if blocks < 1:
            raise ConfigError(f"budget_mb={config.budget_mb} does not hold even one block of {config.block_size} tokens "
                              f"in this mode: raise the budget")
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(blocks)
        tail_dtype = FULL_DTYPES[self.model_dtype]
        self.layers = [tuple(Component(f, config.block_size, m.num_kv_heads, m.head_dim, tail_dtype, self.device)
                             for f in self.formats_for(config, i)) for i in range(m.num_layers)]
        self.table: list[int] = []
        self.num_tokens = 0           # tokens appended since the last reset
        self.evicted_blocks = 0
        self.num_sink_blocks = math.ceil(config.sinks / config.block_size) if config.window else 0

    # ---- sequence geometry ------------------------------------------------------------

    @property
    def seq_len(self) -> int:
        return self.num_tokens - self.evicted_blocks * self.block_size

    def _geometry(self, num_tokens: int) -> tuple[int, int]:
        """(window_start slot, num_sinks) for a stream of num_tokens tokens."""
        c = self.config
        if c.window is None:
            return 0, 0
        sinks = min(c.sinks, num_tokens)
        start_abs = max(c.sinks, num_tokens - c.window)
        sink_end = self.num_sink_blocks * self.block_size
        start = start_abs if start_abs < sink_end else start_abs - self.evicted_blocks * self.block_size
        return min(start, num_tokens - self.evicted_blocks * self.block_size), sinks

    @property
    def tokens_held(self) -> int:
        ws, ns = self._geometry(self.num_tokens)
        return min(ns, self.seq_len) + max(0, self.seq_len - max(ws, ns))

    @property
    def tokens_evicted(self) -> int:
        return self.num_tokens - self.tokens_held

    def blocks_needed(self, num_new: int) -> int:
        return max(0, math.ceil((self.seq_len + num_new) / self.block_size) - len(self.table))

    # ---- one forward step -------------------------------------------------------------

    def begin(self, num_new: int) -> Plan:
        """Allocate blocks for num_new tokens and plan their positions. Caller checked the budget."""
        need = self.blocks_needed(num_new)
        if need:
            self.table.extend(self.pool.allocate_many(need))
            self._resize_pages()
        seq_len = self.seq_len
        ws, ns = self._geometry(self.num_tokens)
        slots, pos = kernels.slot_positions(seq_len, ws, ns)
        past_cos, past_sin = kernels.rope_cos_sin(pos.to(self.device), self.inv_freq)
        new_pos = torch.arange(num_new, device=self.device) + slots.numel()
        new_cos, new_sin = kernels.rope_cos_sin(new_pos, self.inv_freq)
        return Plan(num_new, seq_len, slots, past_cos, past_sin, new_cos, new_sin, seq_len, ws, ns)

    def end(self, plan: Plan) -> int:
        """Account the new tokens and free blocks that left the window; returns blocks freed."""
        self.num_tokens += plan.num_new
        return self._evict()

    def _evict(self) -> int:
        c = self.config
        if c.window is None:
            return 0
        freed = 0
        start_abs = max(c.sinks, self.num_tokens - c.window)
        while len(self.table) > self.num_sink_blocks + 1:
            first_abs = (self.num_sink_blocks + self.evicted_blocks) * self.block_size
            if first_abs + self.block_size > start_abs:
                break
            self.pool.free(self.table.pop(self.num_sink_blocks))
            self.evicted_blocks += 1
            freed += 1
        if freed:
            self._resize_pages()
        return freed

    def _resize_pages(self) -> None:
        n = self.pool.high_water
        for comps in self.layers:
            for comp in comps:
                comp.resize(n)

    # ---- attention ----------------------------------------------------------------------

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (k before RoPE) -> [T, Hq, D]; stores k and v in the cache."""
        kc, vc = self.layers[layer]
        T = q.shape[0]
        assert T == plan.num_new and k.shape[0] == T
        q_rot = kernels.apply_rope(q.float(), plan.new_cos, plan.new_sin)
        k_new = kernels.apply_rope(k.float(), plan.new_cos, plan.new_sin)
        if plan.past_slots.numel():
            k_past = kernels.apply_rope(kc.read_slots(self.table, plan.seq_len, plan.past_slots), plan.past_cos, plan.past_sin)
            v_past = vc.read_slots(self.table, plan.seq_len, plan.past_slots)
            k_all, v_all = torch.cat((k_past, k_new)), torch.cat((v_past, v.float()))
        else:
            k_all, v_all = k_new, v.float()
        kc.write(k, plan.first_slot, self.table)
        vc.write(v, plan.first_slot, self.table)
        P = k_all.shape[0] - T
        mask = None
        if T > 1:
            mask = torch.ones(T, P + T, dtype=torch.bool, device=q.device).tril(diagonal=P)
        out = torch.nn.functional.scaled_dot_product_attention(
            q_rot.transpose(0, 1).unsqueeze(0), k_all.transpose(0, 1).unsqueeze(0),
            v_all.transpose(0, 1).unsqueeze(0), attn_mask=mask, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)

    # ---- memory -------------------------------------------------------------------------

    def layer_bytes(self) -> list[tuple[int, int]]:
        return [(kc.nbytes, vc.nbytes) for kc, vc in self.layers]

    @property
    def nbytes(self) -> int:
        return sum(k + v for k, v in self.layer_bytes())

    def reset(self) -> int:
        freed = self.nbytes
        self._build(self.config)
        return freed
