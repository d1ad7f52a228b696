"""The pages of one layer's K or V: page tensors indexed by block id, plus full-precision blocks.

Quantized components keep two blocks in full precision (the model dtype): the block being filled
(the tail), quantized once when it is full and never again, and the table's first block (the
head), which holds the first tokens and the attention sinks that draw most of the attention.
"""
from __future__ import annotations

import torch

import kernels
from kernels.formats import PageFormat


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
        # the table's first block, full precision, for quantized pages (set when that block fills)
        self.head: torch.Tensor | None = None
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
        for t in (self.tail, self.head):
            if t is not None:
                total += t.numel() * t.element_size()
        return total

    def flat_pages(self) -> torch.Tensor:
        """Full-precision data pages viewed as rows of [H, D]: row = block id * block_size + offset."""
        return self.pages["data"].view(-1, self.num_heads, self.head_dim)

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
        first = start // bs
        if n_full and first == 0:
            self.head = seq[:bs].to(self.tail_dtype).clone()
        if n_full > (first == 0):
            skip = int(first == 0)
            ids = torch.tensor(table[first + skip:first + n_full], dtype=torch.long, device=x.device)
            src = seq[skip * bs:n_full * bs].reshape(n_full - skip, bs, self.num_heads, self.head_dim)
            kernels.store_blocks(src, ids, *self.tensors(), self.fmt)
        rest = seq[n_full * bs:]
        self.tail.zero_()
        self.tail[:rest.shape[0]] = rest.to(self.tail.dtype)

    def read_side(self, table: list[int], slots: torch.Tensor, tail_start: int) -> torch.Tensor:
        """Float32 values [len(slots), H, D] of slots in the head block or at/after tail_start, before a write."""
        if not self.fmt.is_quantized:
            return self.read_slots(table, 0, slots)
        slots = slots.to(self.device)
        out = torch.empty(slots.numel(), self.num_heads, self.head_dim, device=self.device)
        in_tail = slots >= tail_start
        if in_tail.any():
            out[in_tail] = self.tail[slots[in_tail] - tail_start].float()
        if (~in_tail).any():
            out[~in_tail] = self.head[slots[~in_tail]].float()
        return out

    def read_slots(self, table: list[int], seq_len: int, slots: torch.Tensor) -> torch.Tensor:
        """Float32 values [len(slots), H, D] of the chosen slots (< seq_len)."""
        bs = self.block_size
        if not self.fmt.is_quantized:
            blocks = torch.tensor(table, dtype=torch.long)[slots // bs]
            flat = self.pages["data"].view(-1, self.num_heads, self.head_dim)
            return flat.index_select(0, (blocks * bs + slots % bs).to(flat.device)).float()
        n_full = seq_len // bs
        parts = []
        if self.head is not None and n_full:
            parts.append(self.head.float())
        skip = int(self.head is not None)
        if n_full > skip:
            pages = self.read_blocks(torch.tensor(table[skip:n_full], dtype=torch.long, device=self.device))
            parts.append(pages.flatten(0, 1))
        if seq_len > n_full * bs:
            parts.append(self.tail[:seq_len - n_full * bs].float())
        return torch.cat(parts).index_select(0, slots.to(self.device))
