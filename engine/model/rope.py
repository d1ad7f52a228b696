"""RoPE in Python, once: the cos/sin rows of positions, the grown half-table a decode step looks up, and the
rotation (rotate-half layout: frequency i at columns i and i + D/2, as in the C kernels' tables)."""
from __future__ import annotations

import threading

import torch


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor):
    """cos, sin [N, D] (rotate-half layout), angles in float64 so long streams keep exact differences."""
    freqs = positions.double()[:, None] * inv_freq.double()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().float(), emb.sin().float()


ROWS_AHEAD = 256
_runs: dict[bytes, tuple[int, torch.Tensor, torch.Tensor]] = {}     # by inv_freq's bytes: (first, cos, sin) of a run


def rope_rows(first: int, n: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_cos_sin of positions first .. first + n - 1 (inv_freq on the CPU), as views of a run of ROWS_AHEAD rows
    computed ahead: decode steps move one position at a time, so a step looks its row up instead of running eight
    tensor ops (0.1 ms of every step). The same values as rope_cos_sin of those positions alone (elementwise, in
    float64: tests/test_rope.py)."""
    if n > ROWS_AHEAD:          # a prompt's rows: computed, nothing kept
        return rope_cos_sin(torch.arange(first, first + n), inv_freq)
    key = inv_freq.numpy().tobytes()
    run = _runs.get(key)
    if run is None or not run[0] <= first or first + n > run[0] + run[1].shape[0]:
        cos, sin = rope_cos_sin(torch.arange(first, first + ROWS_AHEAD), inv_freq)
        run = _runs[key] = (first, cos, sin)
    at = first - run[0]
    return run[1][at:at + n], run[2][at:at + n]


_tables: dict[tuple[float, ...], tuple[torch.Tensor, torch.Tensor]] = {}      # by inv_freq's values
_tables_lock = threading.Lock()


def rope_table(inv_freq: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [>= n, D/2] float32 of positions 0, 1, ... (one half of rope_cos_sin's rows, the same
    values), kept per inv_freq and grown by doubling, so a decode step looks positions up instead of
    computing a cosine per held token."""
    with _tables_lock:
        key = tuple(inv_freq.tolist())
        cached = _tables.get(key)
        if cached is None or cached[0].shape[0] < n:
            size = max(n, 1024, 2 * cached[0].shape[0] if cached is not None else 0)
            freqs = torch.arange(size, dtype=torch.float64)[:, None] * inv_freq.double().cpu()[None, :]
            cached = _tables[key] = (freqs.cos().float(), freqs.sin().float())
        return cached


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated by per-row cos/sin [N, D] (or [1, D]): x cos + rotate_half(x) sin."""
    n, h, d = x.shape
    swapped = x.view(n, h, 2, d // 2).flip(2).view(n, h, d)
    half = d // 2
    folded = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return (x * cos[:, None]).addcmul_(swapped, folded[:, None])
