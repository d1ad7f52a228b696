"""Gated DeltaNet, the token mixer of a linear-attention layer (spec.LinearAttention says what it computes): the
causal convolution over a sequence's state, and the gated delta rule, one token at a time for decoding and in chunks
for prompts. Float32 throughout, as transformers' reference computes it; no cache here (the state is the caller's).

The chunked form (Yang et al., "Gated Delta Networks", 2024; the WY / UT representation of DeltaNet) computes, per
chunk of C tokens, the corrections every token writes into the state at once: with the decays inside the chunk folded
into a lower-triangular system, one triangular solve gives them, and the state is read and written once per chunk
instead of once per token. The arithmetic differs from the one-token loop only by rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64          # tokens per chunk of a prompt (transformers' default)


def conv(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal depthwise convolution and SiLU over new inputs x [T, C] after a state tail [C, K - 1] (the previous
    K - 1 inputs of each channel, zeros at the start) -> (outputs [T, C], the new tail [C, K - 1])."""
    T, C = x.shape
    K = weight.shape[1]
    seq = torch.cat((tail, x.t().to(tail.dtype)), dim=1)               # [C, K - 1 + T]
    if T == 1:
        out = (seq * weight).sum(1, keepdim=True)                      # [C, 1]
    else:
        out = F.conv1d(seq[None], weight[:, None, :], groups=C)[0]     # [C, T]
    return F.silu(out).t(), seq[:, seq.shape[1] - (K - 1):].clone() if K > 1 else tail


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def prepare(q: torch.Tensor, k: torch.Tensor, value_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, Hk, Dk] -> L2-normalized, q scaled by Dk ** -0.5, each key head repeated for the value heads it serves:
    [T, Hv, Dk]."""
    q, k = _l2norm(q.float()), _l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    rep = value_heads // k.shape[1]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    return q, k


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per call, T tokens in turn: q, k [T, H, Dk] (prepared), v [T, H, Dv], g, beta [T, H]; state
    [H, Dk, Dv] -> (outputs [T, H, Dv], the new state)."""
    out = v.new_empty(v.shape, dtype=torch.float32)
    s = state
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        kt = k[t]
        read = torch.bmm(kt[:, None, :], s)[:, 0]                     # [H, Dv]: k S
        delta = (v[t].float() - read) * beta[t][:, None]
        s = s + kt[:, :, None] * delta[:, None, :]
        out[t] = torch.bmm(q[t][:, None, :], s)[:, 0]
    return out, s


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """step()'s result for a prompt, chunk tokens at a time (see the module's docstring)."""
    T, H, Dk = k.shape
    Dv = v.shape[-1]
    pad = (-T) % chunk
    # [H, n, C, .] with the sequence padded by tokens that neither decay nor write (g 0, beta 0, k 0)
    def chunks(x, width):
        x = x.float().transpose(0, 1)
        if pad:
            x = F.pad(x, (0, 0, 0, pad)) if width else F.pad(x, (0, pad))
        return x.reshape(H, -1, chunk, width) if width else x.reshape(H, -1, chunk)
    q, k, v, g, beta = chunks(q, Dk), chunks(k, Dk), chunks(v, Dv), chunks(g, 0), chunks(beta, 0)
    n = q.shape[1]
    cum = g.cumsum(-1)                                                  # [H, n, C] log decay since the chunk began
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay between positions j <= i of a chunk: exp(cum_i - cum_j); zero above the diagonal
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kb = k * beta[..., None]
    # (I + A) u = beta v, A strictly lower: A_ij = beta_i k_i . k_j decay_ij
    system = (kb @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * decay                           # within the chunk, causal
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    total = cum[..., -1].exp()                                          # [H, n]
    out = torch.empty(H, n, chunk, Dv, dtype=torch.float32, device=q.device)
    s = state.float()
    for c in range(n):
        fresh = u[:, c] - w[:, c] @ s                                   # what each token writes beyond S's reading
        out[:, c] = q_dec[:, c] @ s + inner[:, c] @ fresh
        s = s * total[:, c, None, None] + k_dec[:, c].transpose(-1, -2) @ fresh
    return out.reshape(H, n * chunk, Dv)[:, :T].transpose(0, 1), s


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each value head's output [T, H, Dv] times weight [Dv] and silu(z) [T, H, Dv] -> float32."""
    o = o.float()
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * o) * F.silu(z.float())
