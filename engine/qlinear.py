"""Weight-only int4 linear layers for fast CPU decode (groups of 32, asymmetric).

The default model arrives as a Q4_1 GGUF: every group of 32 weights already sits on a 16-level
grid (w = d * q + m), so re-packing the dequantized values into groups of 32 recovers that grid
(exactly where a group uses its lowest and highest level) and reads 4 bits per weight instead of 32.
Only the matmul inputs are bf16, as torch's packed int4 CPU kernel requires; outputs return to
the model dtype.
"""
from __future__ import annotations

import torch

GROUP = 32


def can_pack(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return weight.device.type == "cpu" and k % GROUP == 0 and n % 16 == 0 and k % 64 == 0 and \
        hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


class Int4Linear:
    """y = x @ W^T (+ b) with W stored as packed int4 + bf16 scales and zero offsets."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        # weight: [N, K] float
        n, k = weight.shape
        w = weight.float().view(n, k // GROUP, GROUP)
        lo = w.amin(-1, keepdim=True)
        scale = ((w.amax(-1, keepdim=True) - lo) / 15).clamp_min(1e-8)
        q = ((w - lo) / scale).round().clamp(0, 15).to(torch.int32).view(n, k)
        # the kernel computes (q - 8) * scale + zero
        zero = lo + 8 * scale
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.scales_zeros = torch.stack((scale.squeeze(-1), zero.squeeze(-1)), -1).transpose(0, 1).contiguous() \
            .to(torch.bfloat16)                                   # [K / 32, N, 2]
        self.bias = bias
        self.out_features, self.in_features = n, k

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K] -> [T, N], in bf16
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP, self.scales_zeros)
        y = y.to(x.dtype)
        return y + self.bias if self.bias is not None else y

    @property
    def nbytes(self) -> int:
        total = self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2
        return total + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)
