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

from kvchat.kernels import cpu_quant

CHUNK = 64          # tokens per chunk of a prompt (transformers' default)


def conv(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal depthwise convolution and SiLU over new inputs x [T, C] after a state tail [K - 1, C] (the previous
    K - 1 inputs of each channel, zeros at the start), weight [K, C] (tap j of every channel; tap K - 1 meets the
    newest input) -> (outputs [T, C], the new tail [K - 1, C]). Rows stay rows: K multiply-adds over [T, C], no
    transposed copies."""
    T = x.shape[0]
    K = weight.shape[0]
    seq = torch.cat((tail, x.to(tail.dtype)))                          # [K - 1 + T, C]
    out = seq[:T] * weight[0]
    for j in range(1, K):
        out.addcmul_(seq[j:j + T], weight[j])
    return F.silu(out), seq[T:].clone()


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
    [H, Dk, Dv] (not written) -> (outputs [T, H, Dv], the new state)."""
    out = v.new_empty(v.shape, dtype=torch.float32)
    s = state
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]                              # a new buffer: the old state stays as it was
        kt = k[t]
        read = torch.bmm(kt[:, None, :], s)[:, 0]                     # [H, Dv]: k S
        delta = (v[t].float() - read) * beta[t][:, None]
        s.baddbmm_(kt[:, :, None], delta[:, None, :])                  # S + k (beta (v - k S))
        out[t] = torch.bmm(q[t][:, None, :], s)[:, 0]
    return out, s


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """step()'s result for a prompt, chunk tokens at a time (see the module's docstring)."""
    T, H, Dk = k.shape
    Dv = v.shape[-1]
    pad = (-T) % chunk

    def chunks(x):          # [T, H, ...] -> [H, n, chunk, ...], padded by tokens that neither decay nor write: one copy
        out = x.new_zeros((H, T + pad, *x.shape[2:]), dtype=torch.float32)
        out[:, :T] = x.transpose(0, 1)
        return out.view(H, -1, chunk, *x.shape[2:])
    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
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


def rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
         state: torch.Tensor, decode: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over rows of one sequence: q, k [T, Hk, Dk] as the convolution gave them, v [T, H, Dv], g,
    beta [T, H]; state [H, Dk, Dv] (not written) -> (outputs [T, H, Dv], the new state). On the CPU with the C
    kernels: one pass per token in C (kernels/cpu_gdn.h), prompt and decode rows alike; else torch, one token at a
    time for decode rows (step) and in chunks for prompts (chunked)."""
    new = state.float().clone()
    if not state.is_cuda:
        out = cpu_quant.gdn_rule(q, k, v, g, beta, new)
        if out is not None:
            return out, new
    qp, kp = prepare(q, k, v.shape[1])
    return (step if decode else chunked)(qp, kp, v, g, beta, state)


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each value head's output [T, H, Dv] times weight [Dv] and silu(z) [T, H, Dv] -> float32."""
    o = o.float()
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * o) * F.silu(z.float())


def mix(proj: torch.Tensor, weights, la, eps: float, tail: torch.Tensor, matrices: torch.Tensor, decode: bool,
        table=None, out: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence's rows through a Gated DeltaNet mixer between its projections: proj [T, >= C + V + 2 H] holds each
    row's mixed (q | k | v before the convolution) | z | b | a; weights the layer's vectors (conv, dt_bias, A, norm);
    the state's tail and matrices are read, not written -> (outputs [T, H * Dv] float32 for out_proj: the rule's
    outputs gated-normed, the new tail, the new matrices). With a C table (cpu_quant.gdn_table) on the CPU, the whole
    mixer is one C call (kernels/cpu_gdn.h: gdn_mix, the one-call decode step's own); else torch, as transformers
    computes it. out: (tail, matrices) buffers apart from the state's for the C mixer's new state (torch's are its
    own)."""
    if table is not None:
        done = cpu_quant.gdn_mix(table, proj, eps, tail, matrices, *(out or ()))
        if done is not None:
            return done
    T = proj.shape[0]
    C, V, H = la.channels, la.value_heads * la.value_dim, la.value_heads
    b, a = proj[:, C + V:C + V + H].float(), proj[:, C + V + H:C + V + 2 * H].float()
    beta, g = torch.sigmoid(b), weights.A * F.softplus(a + weights.dt_bias)
    x, new_tail = conv(proj[:, :C].float(), tail, weights.conv)
    kd = la.key_heads * la.key_dim
    q = x[:, :kd].view(T, la.key_heads, la.key_dim)
    k = x[:, kd:2 * kd].view(T, la.key_heads, la.key_dim)
    v = x[:, 2 * kd:].reshape(T, H, la.value_dim)
    o, new_matrices = rule(q, k, v, g, beta, matrices, decode)
    z = proj[:, C:C + V].view(T, H, la.value_dim)
    return gated_norm(o, z, weights.norm, eps).reshape(T, V), new_tail, new_matrices

