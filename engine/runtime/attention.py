"""The one softmax attention over a sequence's gathered keys and values (the backends in
engine/runtime/backends/ gather them from their pages, and the kernels' references check against it)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


Q_BLOCK = 32        # query rows per block of prompt attention


@dataclass(frozen=True)
class RowMass:
    """Where the last rows of an attention call put their mass (the torch path's measure; the C kernels take a
    cpu_quant.Mass): out [W, Hq, mcols] float32 receives, for the call's last W query rows, each head's softmax
    probability summed per column (cols [N]: the column of each key, in k_all's order), the learned sink's share in
    the last column. mean_of: W rows, their mean into out[0] and the last one into out[1] (out [2, Hq, mcols]: a
    prompt's observation window, bounded whatever its length); 0: one out row per query row."""

    cols: torch.Tensor
    out: torch.Tensor
    mean_of: int = 0


def softmax_attention(q_rot: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, decode: bool = True,
                      scale: float | None = None, softcap: float | None = None,
                      outside: torch.Tensor | None = None, sink_logits: torch.Tensor | None = None,
                      observe: RowMass | None = None) -> torch.Tensor:
    """The one softmax attention (besides the kernels' references): q [T, Hq, D] rotated, k/v [P + T, Hkv, D]
    with the new tokens last (causal among themselves) -> [T, Hq, D].

    scale: what q . k is multiplied by (the layer's query_scale; None: D ** -0.5). softcap: scores become
    cap * tanh(scores / cap) before the softmax (Gemma 2). outside: [T, P + T] bool, True where a key lies outside
    the query's sliding window (a layer's own window over prompt rows; a decode row reads only its window's keys).
    sink_logits: [Hq] float32, one learned logit per query head (gpt-oss) that joins every row's softmax (after the
    cap, not capped itself) and takes its share of the mass with no value: the output is then less than a convex
    combination of the values. None: the plain softmax, bit for bit. observe: where the last rows' mass goes
    (computed apart, after the attention: the output's bits do not change).

    Prompt rows go in blocks of Q_BLOCK queries aligned to multiples of Q_BLOCK positions, each block
    padded to Q_BLOCK rows and reading the keys up to its block's end: a row's result then depends only
    on its position and the keys, not on where its chunk started (a prompt whose start came from the
    prefix cache gives the same bits as one read whole)."""
    T, D = q_rot.shape[0], q_rot.shape[-1]
    Hkv = k_all.shape[1]
    scale = D ** -0.5 if scale is None else scale
    if observe is not None:
        observe_rows(q_rot, k_all, scale, softcap, outside, sink_logits, observe)
    if T == 1 and decode:     # one query: two batched matmuls beat SDPA's GQA expansion on small heads
        scores = _capped(torch.bmm(q_rot[0].view(Hkv, -1, D), k_all.permute(1, 2, 0)) * scale, softcap)
        return torch.bmm(_softmax(scores, sink_logits), v_all.transpose(0, 1)).reshape(1, -1, D)
    N, Hq = k_all.shape[0], q_rot.shape[1]
    G, P = Hq // Hkv, N - T
    out = q_rot.new_empty(T, Hq, D)
    k_t, v_t = k_all.permute(1, 2, 0), v_all.transpose(0, 1)         # [Hkv, D, N], [Hkv, N, D]
    offsets = torch.arange(Q_BLOCK, device=q_rot.device)
    start = P
    while start < N:
        block_end = (start // Q_BLOCK + 1) * Q_BLOCK
        end = min(N, block_end)
        qb = q_rot[start - P:end - P]
        if end - start < Q_BLOCK:
            qb = torch.cat((qb, qb.new_zeros(Q_BLOCK - (end - start), Hq, D)))
        qg = qb.view(Q_BLOCK, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * Q_BLOCK, D)
        scores = _capped(torch.bmm(qg, k_t[:, :, :end]) * scale, softcap)
        future = torch.arange(end, device=q_rot.device)[None, :] > (start + offsets)[:, None]
        if outside is not None:
            rows = outside[start - P:end - P, :end]
            future[:end - start] |= rows
        scores = scores.view(Hkv, G, Q_BLOCK, end).masked_fill_(future, float("-inf"))
        o = torch.bmm(_softmax(scores, sink_logits).view(Hkv, G * Q_BLOCK, end), v_t[:, :end])
        out[start - P:end - P] = o.view(Hkv, G, Q_BLOCK, D).permute(2, 0, 1, 3).reshape(Q_BLOCK, Hq, D)[:end - start]
        start = end
    return out


def prompt_attention(q_rot: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, decode: bool = True,
                     scale: float | None = None, softcap: float | None = None,
                     outside: torch.Tensor | None = None, sink_logits: torch.Tensor | None = None,
                     observe: RowMass | None = None) -> torch.Tensor:
    """softmax_attention's result (same arguments) with prompt rows through the C kernel on the CPU (attn_prompt over
    the gathered keys and values, read in place: no padded blocks of queries); a one-token decode, and what the
    kernel does not take, through softmax_attention. The backends that gather (quantized pages, layers reading
    another layer's KV) call this; softmax_attention stays the kernels' reference."""
    T, D = q_rot.shape[0], q_rot.shape[-1]
    if not (T == 1 and decode) and not q_rot.is_cuda and k_all.dtype == v_all.dtype == torch.float32:
        from kvchat.kernels import cpu_quant
        if cpu_quant.available() and cpu_quant.can_attend_prompt(q_rot.shape[1], k_all):
            scale = D ** -0.5 if scale is None else scale
            if observe is not None:
                observe_rows(q_rot, k_all, scale, softcap, outside, sink_logits, observe)
            rows = torch.arange(k_all.shape[0])
            return cpu_quant.attn_prompt(q_rot, k_all.contiguous(), v_all.contiguous(), rows, scale, softcap, None,
                                         outside, sink_logits)
    return softmax_attention(q_rot, k_all, v_all, decode, scale, softcap, outside, sink_logits, observe)


def observe_rows(q_rot: torch.Tensor, k_all: torch.Tensor, scale: float, softcap: float | None,
                 outside: torch.Tensor | None, sink_logits: torch.Tensor | None, observe: RowMass) -> None:
    """softmax_attention's probabilities of its last W rows (q_rot [T, Hq, D], k_all [N, Hkv, D], the T queries
    the last T keys), summed per column into observe.out [W, Hq, mcols]."""
    T, Hq, D = q_rot.shape
    N, Hkv = k_all.shape[:2]
    W = observe.mean_of or observe.out.shape[0]
    qg = q_rot[T - W:].float().view(W, Hkv, Hq // Hkv, D).permute(1, 2, 0, 3)          # [Hkv, G, W, D]
    scores = _capped(torch.matmul(qg, k_all.float().permute(1, 2, 0)[:, None]) * scale, softcap)  # [Hkv, G, W, N]
    hidden = torch.arange(N)[None, :] > torch.arange(N - W, N)[:, None]                 # causal among the new rows
    if outside is not None:
        hidden |= outside[T - W:].to(hidden.device)
    p = _softmax(scores.masked_fill_(hidden.to(scores.device), float("-inf")), sink_logits)
    p = p.permute(2, 0, 1, 3).reshape(W, Hq, N)
    if observe.mean_of:                                 # the window's mean, then its last row
        p = torch.stack((p.mean(0), p[-1]))
    out = observe.out
    out[..., :-1].index_add_(2, observe.cols.to(out.device), p.to(out.device))
    if sink_logits is not None:
        out[..., -1] = 1 - p.sum(-1).to(out.device)


def _softmax(scores: torch.Tensor, sink_logits: torch.Tensor | None) -> torch.Tensor:
    """scores [Hkv, G, ..., N] -> probabilities over the last axis. With sink_logits [Hkv * G], transformers' gpt-oss
    softmax (each head's sink logit a column that joins it and is dropped): the plain softmax times
    1 / (1 + exp(sink - logsumexp)), which leaves a sink of -inf the plain softmax's bits."""
    p = scores.softmax(-1)
    if sink_logits is None:
        return p
    sink = sink_logits.to(scores).view(*scores.shape[:2], *(1,) * (scores.dim() - 2))
    return p.mul_(torch.sigmoid(torch.logsumexp(scores, -1, keepdim=True) - sink))


def _capped(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    return scores if cap is None else torch.tanh(scores / cap) * cap
