"""One conversation's paged KV cache: per-layer page tensors, the block table, the window.

Block ids come from a BlockPool and are shared by all layers; each layer keeps its own page
tensors for K and for V, so layers may differ in format. Quantized components keep the block
being filled in full precision (the tail) and quantize it once, when it is full; they keep the
first block of the table (the first tokens, which hold the attention sinks) in full precision
too (the head), since most attention mass lands there.

Slots: the block table's blocks laid end to end. With a window, the first `num_sink_blocks`
blocks hold the sinks and blocks that leave the window are freed; in-cache positions follow
StreamingLLM (see kernels.reference.slot_positions).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

import kernels
from kernels import cpu_quant
from kernels.formats import FULL_DTYPES, PageFormat, bytes_per_block, page_format

from .block_pool import BlockPool
from .config import CacheConfig, ConfigError
from .kv_pages import Component
from .model import ModelConfig

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Plan:
    """What one forward step over T new tokens needs, shared by every layer."""
    num_new: int
    first_slot: int
    past_slots: torch.Tensor      # [P] valid slots before this step
    seq_len: int                  # slots before this step
    window_start: int
    num_sinks: int
    all_flat: torch.Tensor        # [P + T] page rows (block id * bs + offset) of past and new slots
    new_flat: torch.Tensor        # [T] page rows of the new slots
    all_cos: torch.Tensor         # [P + T, D]
    all_sin: torch.Tensor         # [P + T, D], sign-folded for fast_rope
    new_cos: torch.Tensor         # [T, D], the new tokens' rows of all_cos
    new_sin: torch.Tensor         # [T, D], the new tokens' rows of all_sin
    contiguous: bool              # all_flat == 0..P+T-1: pages can be sliced instead of gathered


def fold_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [N, D] -> [-sin_lo, sin_hi], so rotate_half(x) * sin == swap_halves(x) * folded."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def fast_rope(x: torch.Tensor, cos: torch.Tensor, sin_folded: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated (rotate-half RoPE) in three ops; equals kernels.apply_rope."""
    n, h, d = x.shape
    swapped = x.view(n, h, 2, d // 2).flip(2).view(n, h, d)
    return (x * cos[:, None]).addcmul_(swapped, sin_folded[:, None])


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
        return tuple(self._fit(page_format(f, role, config.k_scheme, self.model_dtype))
                     for f, role in ((config.k_format, "k"), (config.v_format, "v")))

    def _fit(self, fmt: PageFormat) -> PageFormat:
        # groups of 32 channels need head_dim to split evenly; smaller heads use smaller groups
        if fmt.scale_axis == "group" and self.model.head_dim % fmt.group:
            return dataclasses.replace(fmt, group=math.gcd(fmt.group, self.model.head_dim))
        return fmt

    def layout_bytes(self, config: CacheConfig) -> tuple[int, int]:
        """(bytes of one block over all layers, fixed bytes of the full-precision tails and heads) for a config."""
        m = self.model
        per_block = tail = 0
        elem = torch.empty((), dtype=FULL_DTYPES[self.model_dtype]).element_size()
        for layer in range(m.num_layers):
            for fmt in self.formats_for(config, layer):
                per_block += bytes_per_block(fmt, config.block_size, m.num_kv_heads, m.head_dim)
                if fmt.is_quantized:
                    tail += 2 * config.block_size * m.num_kv_heads * m.head_dim * elem
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
        P = slots.numel()
        all_pos = torch.cat((pos, torch.arange(P, P + num_new)))
        cos, sin = self._rope_rows(all_pos)
        bs = self.block_size
        all_slots = torch.cat((slots, torch.arange(seq_len, seq_len + num_new)))
        table = torch.tensor(self.table, dtype=torch.long)
        all_flat = (table[all_slots // bs] * bs + all_slots % bs).to(self.device)
        # a single conversation without a window holds blocks 0..n-1 in order (lowest id first)
        contiguous = P == seq_len and all(b == i for i, b in enumerate(self.table))
        sin_folded = fold_sin(sin)
        return Plan(num_new, seq_len, slots, seq_len, ws, ns, all_flat, all_flat[P:], cos, sin_folded,
                    cos[P:], sin_folded[P:], contiguous)

    def _rope_rows(self, positions: torch.Tensor):
        """cos, sin [len(positions), D] from a table grown on demand (positions repeat every step)."""
        need = int(positions.max()) + 1 if positions.numel() else 1
        table = getattr(self, "_rope_table", None)
        if table is None or table[0].shape[0] < need:
            size = 1 << max(8, (need - 1).bit_length())
            table = kernels.rope_cos_sin(torch.arange(size, device=self.device), self.inv_freq)
            self._rope_table = table
        idx = positions.to(self.device)
        return table[0].index_select(0, idx), table[1].index_select(0, idx)

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
            if self.num_sink_blocks == 0:      # the first block leaves: so does its full-precision copy
                for comps in self.layers:
                    for comp in comps:
                        comp.head = None
            self.pool.free(self.table.pop(self.num_sink_blocks))
            self.evicted_blocks += 1
            freed += 1
        # the page tensors keep their size: the next block reuses the lowest free id, so a full
        # window holds constant memory instead of shrinking and regrowing by one block each step
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
        if q.is_cuda and T == 1:
            return self._attend_paged(kc, vc, q, k, v, plan)
        if not (kc.fmt.is_quantized or vc.fmt.is_quantized):
            return self._attend_dense(kc, vc, q, k, v, plan)
        # quantized pages: read the past before writing, since a write may quantize the tail away
        k_all, v_all = k.float(), v.float()
        if plan.past_slots.numel():
            k_all = torch.cat((kc.read_slots(self.table, plan.seq_len, plan.past_slots), k_all))
            v_all = torch.cat((vc.read_slots(self.table, plan.seq_len, plan.past_slots), v_all))
        kc.write(k, plan.first_slot, self.table)
        vc.write(v, plan.first_slot, self.table)
        return self._attention(q, fast_rope(k_all, plan.all_cos, plan.all_sin), v_all, plan)

    def _attend_dense(self, kc: Component, vc: Component, q, k, v, plan: Plan) -> torch.Tensor:
        """Full-precision pages: write the new tokens, then read past and new slots in one gather."""
        k_pages, v_pages = kc.flat_pages(), vc.flat_pages()
        k_pages.index_copy_(0, plan.new_flat, k.to(k_pages.dtype))
        v_pages.index_copy_(0, plan.new_flat, v.to(v_pages.dtype))
        if q.shape[0] == 1 and cpu_quant.can_attend(q, k_pages):
            # one call per layer: keys rotated in registers, no gathered or re-rotated copies
            out = cpu_quant.attn_decode(q[0].float().contiguous(), plan.new_cos[0], plan.new_sin[0], k_pages, v_pages,
                                        plan.all_flat, plan.all_cos, plan.all_sin, q.shape[-1] ** -0.5)
            return out.view(1, *out.shape)
        if plan.contiguous:
            n = plan.all_flat.shape[0]
            k_all, v_all = k_pages[:n].float(), v_pages[:n].float()
        else:
            k_all, v_all = k_pages.index_select(0, plan.all_flat).float(), v_pages.index_select(0, plan.all_flat).float()
        return self._attention(q, fast_rope(k_all, plan.all_cos, plan.all_sin), v_all, plan)

    @staticmethod
    def _attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, plan: Plan) -> torch.Tensor:
        """q [T, Hq, D] before RoPE; k_all (rotated) / v_all [P + T, Hkv, D], the new tokens last -> [T, Hq, D]."""
        T = q.shape[0]
        q_rot = fast_rope(q.float(), plan.new_cos, plan.new_sin)
        if T == 1:     # one query: three batched matmuls beat SDPA's GQA expansion on small heads
            Hkv, D = k_all.shape[1], k_all.shape[2]
            scores = torch.bmm(q_rot[0].view(Hkv, -1, D), k_all.permute(1, 2, 0)) * D ** -0.5   # [Hkv, g, P+1]
            return torch.bmm(scores.softmax(-1), v_all.transpose(0, 1)).reshape(1, -1, D)
        P = k_all.shape[0] - T
        mask = torch.ones(T, P + T, dtype=torch.bool, device=q.device).tril(diagonal=P)
        out = torch.nn.functional.scaled_dot_product_attention(
            q_rot.transpose(0, 1).unsqueeze(0), k_all.transpose(0, 1).unsqueeze(0),
            v_all.transpose(0, 1).unsqueeze(0), attn_mask=mask, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)

    def _attend_paged(self, kc: Component, vc: Component, q, k, v, plan: Plan) -> torch.Tensor:
        """CUDA decode: the paged kernel over whole quantized blocks, merged with the full-precision rest.

        q [1, Hq, D], k/v [1, Hkv, D] -> [1, Hq, D], the same result as the gather path. The slots split
        into the head block [0, lo) and the partial block [hi, seq_len), held in full precision by quantized
        components and attended here, and the blocks [lo, hi) in between, which the kernel reads from the
        pages. Without quantized components lo = 0, hi = seq_len and the kernel reads everything.
        """
        bs = self.block_size
        quantized = kc.fmt.is_quantized or vc.fmt.is_quantized
        seq_len = plan.seq_len + 1
        lo = bs if any(c.head is not None for c in (kc, vc)) else 0
        hi = (plan.seq_len // bs) * bs if quantized else seq_len
        slots, pos = kernels.slot_positions(seq_len, plan.window_start, plan.num_sinks)   # CPU geometry
        new_pos = int(pos[-1])
        side = (slots < lo) | (slots >= hi)
        side_slots, side_pos = slots[side], pos[side]
        if quantized:            # read before writing: the write may quantize the tail block away
            k_side = torch.cat((kc.read_side(self.table, side_slots[:-1], hi), k.float()))
            v_side = torch.cat((vc.read_side(self.table, side_slots[:-1], hi), v.float()))
        kc.write(k, plan.first_slot, self.table)
        vc.write(v, plan.first_slot, self.table)
        D = q.shape[-1]
        sm_scale = 1.0 / math.sqrt(D)
        out = lse = None
        if quantized:            # the side slots always include the new token
            q_rot = fast_rope(q.float(), plan.new_cos, plan.new_sin)
            cos, sin = kernels.rope_cos_sin(side_pos.to(q.device), self.inv_freq)
            k_side = kernels.apply_rope(k_side, cos, sin)
            Hkv = k_side.shape[1]
            scores = torch.einsum("hgd,rhd->hgr", q_rot[0].view(Hkv, -1, D), k_side) * sm_scale
            lse = torch.logsumexp(scores, -1)                                               # [Hkv, g]
            out = torch.einsum("hgr,rhd->hgd", (scores - lse[..., None]).exp(), v_side).reshape(1, -1, D)
            lse = lse.reshape(1, -1)
        ws, ns = max(plan.window_start - lo, 0), max(plan.num_sinks - lo, 0)
        mid_pos = pos[(slots >= lo) & (slots < hi)]
        if hi - lo > 0 and mid_pos.numel():
            _, shifted = kernels.slot_positions(hi - lo, ws, ns)
            assert shifted.numel() == mid_pos.numel()
            offset = int(mid_pos[0] - shifted[0])      # RoPE scores depend on q - k only: shift q instead
            q_cos, q_sin = kernels.rope_cos_sin(torch.tensor([new_pos - offset], device=q.device), self.inv_freq)
            i32 = dict(dtype=torch.int32, device=q.device)
            mid_out, mid_lse = kernels.paged_decode_attention(
                kernels.apply_rope(q.float(), q_cos, q_sin), *kc.tensors(), *vc.tensors(),
                torch.tensor([self.table[lo // bs:-(-hi // bs)]], **i32), torch.tensor([hi - lo], **i32),
                torch.tensor([ws], **i32), torch.tensor([ns], **i32), self.inv_freq, sm_scale, kc.fmt, vc.fmt)
            out, lse = (mid_out, mid_lse) if out is None else kernels.merge_attention(out, lse, mid_out, mid_lse)
        return out.to(q.dtype)

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
