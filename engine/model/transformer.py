"""Our own compact forward pass over transformers' weights, read from the model's description.

The model never sees the cache layout: each layer hands q, k, v (keys before RoPE) to an
attention callback that owns positions, rotation, the paged cache and the softmax.

What a layer computes is its LayerSpec (engine/model/spec.py, built by the family registry). This forward
computes the norms (w * RMSNorm, the (1 + w) folded into the weights at load), q/k norms per head, post-norms
(Gemma: a norm after attention and after the MLP, before each residual add), the gated MLP's activation (SwiGLU,
GELU tanh), the biases, and the model-level embedding scale and final soft-cap. Rotation, query scale, soft-cap
and window are the attention callback's (a partial rotation reaches it as a whole-head one: Rope.permutation); a
linear-attention layer's state is the callback's too (`recurrent`).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from kvchat import kernels
from kvchat.kernels import cpu_quant, cpu_step

from kvchat.engine.model.config import ModelConfig
from kvchat.engine.model.experts import RoutedMLP
from kvchat.engine.model.linears import rms_norm
from kvchat.engine.model.spec import LayerSpec


Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DecodeKernel:
    """An attention backend's whole decode step in C: run(table, x, ple) takes the model's layer table
    (Transformer.kernel_layers), x [B, hidden] fp32, the new tokens' embeddings, and Gemma 4's per-layer inputs (or
    None), and leaves the last layer's output in x, every layer's attention and cache writes included. kind names
    the backend's pages."""

    kind: str
    run: Callable[[object, torch.Tensor, torch.Tensor | None], None]


class Layer:
    """One decoder layer's weights: q/k/v and gate/up fused so a step runs fewer, larger matmuls. Norms hold the
    multiplier each applies (Gemma's 1 + w already added); q_norm / k_norm [head_dim] where the spec has qk_norm,
    post_attn_norm / post_mlp_norm where it has post_norms, else None. A mixture-of-experts layer has `mlp` (an
    experts.RoutedMLP) instead of gate_up / down; sinks: the learned sink logits [num_heads] float32 where the spec
    has sink_logits (the attention backends read them through runner's LayerScores).

    A linear-attention layer (spec.linear) keeps its projections in the same slots: qkv is in_proj_qkv | in_proj_z |
    in_proj_b | in_proj_a fused, o is out_proj; `mixer` holds its vectors (conv [kernel, channels], dt_bias, A, the
    gated norm's multiplier). `shared`: a shared expert beside the routed MLP, (gate_up, down, gate [1, hidden]).
    `ple`: per-layer input embeddings' (gate [ple, hidden], projection [hidden, ple], norm [hidden]) (Gemma 4);
    `scalar`: the layer output's multiplier [1] (spec.output_scale). `beside`: a routed MLP beside the dense one
    (Experts.beside_dense): the norms (after the dense MLP, before the experts, after the experts)."""
    __slots__ = ("qkv", "o", "gate_up", "down", "norm_attn", "norm_mlp", "q_norm", "k_norm", "post_attn_norm",
                 "post_mlp_norm", "mlp", "sinks", "mixer", "shared", "ple", "scalar", "beside")

    def __init__(self, qkv, o, gate_up, down, norm_attn: torch.Tensor, norm_mlp: torch.Tensor,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                 post_attn_norm: torch.Tensor | None = None, post_mlp_norm: torch.Tensor | None = None,
                 mlp: RoutedMLP | None = None, sinks: torch.Tensor | None = None,
                 mixer: "MixerWeights | None" = None, shared: tuple | None = None, ple: tuple | None = None,
                 scalar: torch.Tensor | None = None, beside: tuple | None = None):
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.ple, self.scalar, self.beside = ple, scalar, beside
        self.norm_attn, self.norm_mlp = norm_attn, norm_mlp
        self.q_norm, self.k_norm = q_norm, k_norm
        self.post_attn_norm, self.post_mlp_norm = post_attn_norm, post_mlp_norm
        self.mlp, self.sinks = mlp, sinks
        self.mixer, self.shared = mixer, shared

    def norms(self) -> list[torch.Tensor]:
        """The layer's vectors: norms, sink logits, the routed MLP's biases and a linear mixer's vectors."""
        extra = [self.sinks] + (self.mlp.tensors() if self.mlp is not None else [])
        extra += list(self.mixer.tensors()) if self.mixer is not None else []
        extra += [self.ple[2], self.scalar] if self.ple is not None else [self.scalar]
        extra += list(self.beside) if self.beside is not None else []
        return [t for t in (self.norm_attn, self.norm_mlp, self.q_norm, self.k_norm, self.post_attn_norm,
                            self.post_mlp_norm, *extra) if t is not None]

    def linears(self) -> list:
        """Every linear of the layer (a routed MLP's router and experts, a shared expert included)."""
        dense = [p for p in (self.qkv, self.o, self.gate_up, self.down) if p is not None]
        shared = list(self.shared) if self.shared is not None else []
        ple = list(self.ple[:2]) if self.ple is not None else []
        return dense + (self.mlp.linears() if self.mlp is not None else []) + shared + ple


@dataclass(frozen=True)
class MixerWeights:
    """A linear-attention layer's vectors (spec.LinearAttention): conv [kernel, channels], dt_bias and A [value
    heads] (A = -exp(A_log), the decay rate), norm [value_dim] (the gated RMSNorm's multiplier), all float32;
    out_order: the order out_proj's input is taken in, where its columns are stored otherwise (weights.from_gguf)."""
    conv: torch.Tensor
    dt_bias: torch.Tensor
    A: torch.Tensor
    norm: torch.Tensor
    out_order: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.conv, self.dt_bias, self.A, self.norm


def _rotation_order(config: ModelConfig, layers: list, device) -> tuple[list, list]:
    """(layers, orders): a partial rotation's order of each head's dimensions (Rope.permutation) per layer, None
    where every dimension turns. Where q and k are plain rows of the projection (LayerSpec.plain_qk_rows: Phi-3),
    the order becomes the weights' own: a copy of the layer whose q and k rows (and q / k norms) are taken in it, so
    no step gathers and the one-call C step runs the layer; its order is then None. Elsewhere (Qwen3.5's gated
    queries, a layer over another's KV) each step takes q and k in the order. The caller's layers stay as they
    are (another model may share them)."""
    orders = [None if spec.linear is not None else spec.rope.permutation(config.layer_head_dim(i))
              for i, spec in enumerate(config.layers)]
    layers = list(layers)
    for i, (spec, L) in enumerate(zip(config.layers, layers)):
        gated = spec.attn_gate and spec.order_in_weights
        if not gated and (orders[i] is None or not spec.order_in_weights):
            continue
        L = layers[i] = copy.copy(L)
        hd, kvh, H = config.layer_head_dim(i), config.layer_kv_heads(i), config.num_heads
        o = torch.arange(hd) if orders[i] is None else torch.from_numpy(orders[i])
        heads = lambda n, base, step=hd: (base + torch.arange(n)[:, None] * step + o).reshape(-1)   # noqa: E731
        if gated:       # each head's (query | gate) -> the queries, then the gates, then k and v
            gates = (hd + torch.arange(H)[:, None] * 2 * hd + torch.arange(hd)).reshape(-1)
            ids = torch.cat((heads(H, 0, 2 * hd), gates, heads(kvh, 2 * H * hd),
                             torch.arange((2 * H + kvh) * hd, L.qkv.out_features)))
        else:
            ids = torch.cat((heads(H, 0), heads(kvh, H * hd), torch.arange((H + kvh) * hd, L.qkv.out_features)))
        L.qkv = L.qkv.take_rows(ids.to(device))
        if L.q_norm is not None and orders[i] is not None:
            L.q_norm, L.k_norm = L.q_norm[o.to(L.q_norm.device)], L.k_norm[o.to(L.k_norm.device)]
        orders[i] = None
    return layers, orders


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension without a multiplier, statistics in fp32 (Gemma 4's v norm): in place in C
    on the CPU in fp32 (x [T, heads, D] the step's own rows), torch elsewhere."""
    if not kernels.gpu_path(x) and cpu_quant.head_norm_(x, None, eps):
        return x
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)


def _head_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head times w (q / k norms): in place in C on the CPU in fp32 (the step's own rows), torch
    elsewhere."""
    if not kernels.gpu_path(x) and cpu_quant.head_norm_(x, w, eps):
        return x
    return rms_norm(x, w, eps)


class Transformer:
    """The forward pass over linears of any kind (see model/linears.py): dense, packed int4 or int8.

    `table` is the embedding matrix as a linear: `table.rows(ids)` dequantizes only the rows asked
    for, and a tied output head is the same object, so its bytes are held once. `weights` names the weight path: "dense" (the exact reference), "gguf" (the file's blocks kept
    packed), "int8" / "int4" (float weights quantized on load), or the stored dtype.
    """

    def __init__(self, config: ModelConfig, table, layers: list[Layer], norm: torch.Tensor, lm_head,
                 dtype: torch.dtype, device: str, weights: str, quant: str = "", per_layer: tuple | None = None):
        for i, (spec, L) in enumerate(zip(config.layers, layers)):
            # the weights a spec's fields need (a loader that built a Layer without them is a programming error)
            for name, need in (("q_norm", spec.qk_norm), ("k_norm", spec.qk_norm and spec.kv_source is None),
                               ("post_attn_norm", spec.post_norms), ("post_mlp_norm", spec.post_norms),
                               ("mlp", spec.experts is not None), ("sinks", spec.sink_logits),
                               ("mixer", spec.linear is not None),
                               ("shared", spec.experts is not None and spec.experts.shared_ffn > 0),
                               ("ple", config.per_layer_input > 0), ("scalar", spec.output_scale)):
                if need and getattr(L, name) is None:
                    raise ValueError(f"layer {i}: its spec asks for {name}, but the layer has no such weight")
        self.config = config
        self.table = table
        self.norm = norm
        self.lm_head = lm_head
        self.dtype = dtype
        self.device = device
        self.weights = weights
        self.quant = quant              # what the file holds, e.g. "Q4_1 (+Q8_0)"; "" for float sources
        self.per_layer = per_layer      # per-layer input embeddings' (table, projection, norm), or None
        if (per_layer is None) != (config.per_layer_input == 0):
            raise ValueError("per-layer input embeddings: the config and the weights disagree")
        self.inv_freq = config.inv_freq().to(device)
        # a partial rotation's order of each head's dimensions (Rope.permutation), per layer: None where all turn or
        # where the layer's own rows are in it already (_rotation_order)
        self.layers, orders = _rotation_order(config, layers, device)
        self._order = [None if o is None else torch.from_numpy(o).to(device) for o in orders]
        self._kernel_layers = None          # decode_layers' table, built on first use (kernel_layers)
        self._kernel_checked = False
        self._states_in_c: bool | None = None      # states_in_c(), found once
        self._own_attention: tuple | None = None    # own_attention(), found once
        self._gdn_tables: dict = {}         # layer -> its mixer's C form (cpu_quant.gdn_table) or None, on first use
        self._shared_tables: dict = {}      # id(Layer) -> its shared expert's C form (cpu_quant.shared_table) or None
        self._gdn_layers: list[int] = []    # the layers whose Gated DeltaNet the one-call step runs (kernel_layers)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, attention: Attention, all_logits: bool = False,
                rows: list[int] | None = None, num_decode: int | None = None) -> torch.Tensor:
        """token_ids: [T] -> logits float32 [T, vocab] (all_logits), [len(rows), vocab] for the chosen rows
        (a batch's last tokens), or [1, vocab] for the last token. num_decode: how many leading tokens are
        decode rows (see qlinear: packed linears run them through the kernel, prompt rows through the
        GEMM, so that batching never changes a row's numbers); None lets the row count decide."""
        c = self.config
        T = token_ids.shape[0]
        x = self._embed(token_ids)
        eps = c.rms_norm_eps
        split = num_decode
        per_layer = self._per_layer_inputs(token_ids, x, split)
        for i, (L, spec) in enumerate(zip(self.layers, c.layers)):
            qkv = L.qkv.fused(x, norm=L.norm_attn, eps=eps, split=split)
            if spec.linear is not None:         # a recurrent state instead of a KV cache
                o = self._linear_mixer(i, L, spec, qkv, attention)
            else:
                o = self._attend(i, L, spec, qkv, attention)
                o = o.reshape(T, o.shape[1] * o.shape[2]).to(self.dtype)
            if spec.post_norms:                 # normed after attention, then added (not o_proj's fused residual)
                x = _post_add(x, L.o.fused(o, split=split), L.post_attn_norm, eps)
            else:
                x = L.o.fused(o, residual=x, split=split)
            x = self._mlp(L, spec, x, split)
            if per_layer is not None:           # the layer's own input embedding, gated by its output
                gate, proj, norm = L.ple
                h = _gelu_times(gate(x, split=split), per_layer[:, i])
                x = _post_add(x, proj(h, split=split), norm, eps)
            if L.scalar is not None:
                x = x * L.scalar.to(x.dtype)
        if rows is not None:
            x = x[rows]
            split = None if num_decode is None else len(rows)    # one row per sequence: all through the kernel
        elif not all_logits:
            x = x[-1:]
            split = None
        return self._capped(self.lm_head.fused(x, norm=self.norm, eps=eps, split=split).float())

    def _mlp(self, L: Layer, spec: LayerSpec, x: torch.Tensor, split) -> torch.Tensor:
        """x plus the layer's MLP: dense, routed (with a shared expert, or beside a dense MLP), post-normed or not."""
        eps = self.config.rms_norm_eps
        if L.shared is not None:            # a routed MLP with a shared expert beside it
            y = L.mlp.fused(x, L.norm_mlp, eps, x, split)
            table = self._shared_table(L) if y.dtype == torch.float32 and not kernels.gpu_path(x) else None
            n = cpu_quant.decode_split(x.shape[0], split)
            if table is None or not n:
                return self._shared(L, x, y, split)
            cpu_quant.shared_expert_(y[:n], x[:n], L.norm_mlp, eps, table)     # decode rows: the one-call step's C
            return y if n == x.shape[0] else torch.cat((y[:n], self._shared(L, x[n:], y[n:], 0)))
        if L.mlp is not None and L.beside is None:      # a routed MLP: only the experts each row is routed to
            y = L.mlp.fused(x, L.norm_mlp, eps, None if spec.post_norms else x, split)
            return x + rms_norm(y, L.post_mlp_norm, eps) if spec.post_norms else y
        gu = L.gate_up.fused(x, norm=L.norm_mlp, eps=eps, split=split)
        if L.beside is not None:            # Gemma 4: the dense MLP and the experts side by side, each normed after
            post_dense, pre_experts, post_experts = L.beside
            dense = L.down.fused(gu, swiglu=True, split=split, act=spec.activation)
            routed = L.mlp.fused(x, pre_experts, eps, None, split)
            out = None if kernels.gpu_path(x) else cpu_quant.beside_add(x, dense, routed, L.beside, L.post_mlp_norm,
                                                                          eps)     # the one-call step's C
            if out is not None:
                return out
            return x + rms_norm(rms_norm(dense, post_dense, eps) + rms_norm(routed, post_experts, eps),
                                L.post_mlp_norm, eps)
        if spec.post_norms:
            return _post_add(x, L.down.fused(gu, swiglu=True, split=split, act=spec.activation), L.post_mlp_norm, eps)
        return L.down.fused(gu, swiglu=True, residual=x, split=split, act=spec.activation)

    def _shared(self, L: Layer, x: torch.Tensor, y: torch.Tensor, split) -> torch.Tensor:
        """y + the shared expert of rms_norm(x), through the linears (prompt rows, or where C does not take it)."""
        gu, down, gate = L.shared
        h = rms_norm(x, L.norm_mlp, self.config.rms_norm_eps)
        return y + down.fused(gu(h, split=split), swiglu=True, split=split) * torch.sigmoid(gate(h, split=split))

    def _shared_table(self, L: Layer):
        """Layer L's shared expert as the C kernels read it (cpu_quant.shared_table), made on first use; None where
        they do not (a linear not packed, a gate that is not an fp32 row)."""
        if id(L) not in self._shared_tables:
            gu, down, gate = L.shared
            parts = [getattr(lin, "kernel_parts", lambda: None)() for lin in (gu, down)]
            weight = getattr(gate, "weight", None)
            self._shared_tables[id(L)] = None if any(p is None for p in parts) or weight is None \
                or gate.bias is not None or weight.shape[0] != 1 else cpu_quant.shared_table(parts[0], parts[1], weight)
        return self._shared_tables[id(L)]

    def _attend(self, i: int, L: Layer, spec: LayerSpec, qkv: torch.Tensor, attention: Attention) -> torch.Tensor:
        """Softmax attention of layer i over its KV cache (the callback's): q, k, v from the fused projection at the
        layer's own head size (with Qwen3.5's output gate, each head's query then its gate; Gemma 4's v from k_proj
        where keys are values, v normed), q / k norms, a partial rotation's order. A layer over another layer's KV
        (spec.kv_source) has q only: the callback gets k = v = None and reads the source's cache."""
        c, eps = self.config, self.config.rms_norm_eps
        T = qkv.shape[0]
        hd, kvh, H = c.layer_head_dim(i), c.layer_kv_heads(i), c.num_heads
        gate = None
        if spec.attn_gate:          # q | gate | k | v (_rotation_order moved the gates aside): the gates, then q | k | v
            gate = qkv[:, H * hd:2 * H * hd].contiguous()
            qkv = torch.cat((qkv[:, :H * hd], qkv[:, 2 * H * hd:]), 1)
        if spec.kv_source is not None or spec.value_from_key or spec.value_norm:
            q = qkv[:, :H * hd].view(T, H, hd)
            k = v = None
            if spec.kv_source is None:
                k = qkv[:, H * hd:H * hd + kvh * hd].view(T, kvh, hd)
                v = k.clone() if spec.value_from_key else qkv[:, H * hd + kvh * hd:].view(T, kvh, hd)
                v = _unit_rms(v, eps) if spec.value_norm else v
            if spec.qk_norm:
                q, k = _head_norm(q, L.q_norm, eps), None if k is None else _head_norm(k, L.k_norm, eps)
        else:
            if spec.qk_norm:
                qkv = qkv.contiguous()
            q, k, v = self._split_qkv(qkv, H, kvh, hd)
            if spec.qk_norm:                    # per head, over head_dim, before the callback rotates them
                # on the CPU in fp32 the one-call step's own norm (in place; q, k are views), so both give one bits
                if kernels.gpu_path(qkv) or not cpu_quant.qk_norm_(qkv, H, kvh, hd, L.q_norm, L.k_norm, eps):
                    q, k = rms_norm(q, L.q_norm, eps), rms_norm(k, L.k_norm, eps)
        order = self._order[i]
        if order is not None:                   # a partial rotation as a whole-head one (Rope.permutation)
            q, k = q[..., order], k[..., order]
        o = attention(i, q, k, v)
        if gate is None:
            return o
        # on the CPU in fp32 the one-call step's own gate (in place: the output is the step's), so both give one bits
        if not kernels.gpu_path(o) and o.is_contiguous() and cpu_quant.sigmoid_mul_(o, gate):
            return o
        return o * torch.sigmoid(gate).to(o.dtype)

    def _per_layer_inputs(self, token_ids: torch.Tensor, x: torch.Tensor, split) -> torch.Tensor | None:
        """Gemma 4's per-layer input embeddings [T, layers, width] (None without them): each token's row of the
        second table times sqrt(width), plus the RMS-normed projection of its scaled embedding x times
        hidden ** -0.5, the sum times 2 ** -0.5."""
        if self.per_layer is None:
            return None
        c = self.config
        table, proj, norm = self.per_layer
        T, n, w = token_ids.shape[0], c.num_layers, c.per_layer_input
        own = table.rows(token_ids).to(self.dtype).view(T, n, w) * (w ** 0.5)
        mixed = (proj(x, split=split) * c.hidden_size ** -0.5).view(T, n, w)
        return (rms_norm(mixed, norm, c.rms_norm_eps) + own) * 2 ** -0.5

    def _linear_mixer(self, i: int, L: Layer, spec: LayerSpec, proj: torch.Tensor, attention) -> torch.Tensor:
        """Gated DeltaNet (spec.LinearAttention) over the step's rows: the projections (q | k | v, z, b, a) are the
        rows' own; the convolution, the delta rule and the gated norm run over each sequence's state through the
        callback's `recurrent` (in one C call where the kernels take the layer: gdn_table). -> [T, value_heads *
        value_dim] in the model dtype, for out_proj."""
        W = L.mixer
        o = attention.recurrent(i, proj, W, spec.linear, self.config.rms_norm_eps, self._gdn_table(i, spec))
        o = o.to(self.dtype)
        return o if W.out_order is None else o[:, W.out_order]

    def _kernel_row(self, L: Layer, spec: LayerSpec, i: int) -> "cpu_step.LayerRow | None":
        """Layer i as the one-call step's table takes it (cpu_step.LayerRow), or None where the kernel cannot take
        it: a linear not packed (or of too many parts), norms not fp32 contiguous."""
        def fp32(*ts):
            return all(t is not None and t.dtype == torch.float32 and t.is_contiguous() for t in ts)
        moe = None if L.mlp is None else L.mlp.kernel_table()
        mlp = (L.gate_up, L.down) if L.mlp is None or L.beside is not None else ()
        slots = [lin.kernel_parts() for lin in (L.qkv, L.o, *mlp)]
        own = spec.own_heads                    # a mixer C attends itself where its pages are C's (Gemma 4)
        qk = (None, None) if (spec.mixer_called_back and not own) or L.q_norm is None else \
            (L.q_norm, L.q_norm if L.k_norm is None and spec.kv_source is not None else L.k_norm)  # q only: no k's
        post = (L.post_attn_norm, L.post_mlp_norm) if spec.post_norms else (None, None)
        shared = None if L.shared is None else self._shared_table(L)
        if any(p is None for p in slots) or len(slots[1]) != 1 or (len(slots) == 4 and len(slots[3]) != 1) \
                or (L.mlp is not None and moe is None) or not fp32(L.norm_attn, L.norm_mlp) \
                or (L.shared is not None and shared is None) \
                or (qk[0] is not None and not fp32(*qk)) or (spec.post_norms and not fp32(*post)) \
                or (L.scalar is not None and L.scalar.dtype != torch.float32) \
                or (L.beside is not None and not fp32(*L.beside, L.post_mlp_norm)):
            return None
        ple = None
        if L.ple is not None:                   # Gemma 4's per-layer input: one packed part each
            gate, proj, norm = L.ple
            parts = [getattr(lin, "kernel_parts", lambda: None)() for lin in (gate, proj)]
            if any(p is None or len(p) != 1 for p in parts) or not fp32(norm):
                return None
            ple = (parts[0][0], parts[1][0], norm)
        gdn = None
        if spec.linear is not None and self._gdn_table(i, spec) is not None:
            gdn = (self._gdn_table(i, spec), sum(s.linear is not None for s in self.config.layers[:i]),
                   L.mixer.out_order)
        gate = self.config.num_heads * self.config.layer_head_dim(i) if spec.attn_gate else 0
        heads = None
        if own:
            c = self.config
            sources = c.kv_sources                          # layer -> the layer whose KV it reads
            kept = sorted(set(sources.values()))            # the layers whose keys and values are kept, a slot each
            heads = (c.layer_head_dim(i), c.layer_kv_heads(i), int(spec.value_from_key), int(spec.value_norm),
                     kept.index(i) + 1 if i in kept else 0, kept.index(sources[i]) + 1 if i in sources else 0)
        return cpu_step.LayerRow(slots + [[], []] if len(slots) == 2 else slots, L.norm_attn, L.norm_mlp, *qk, moe,
                                 *post, 1 if spec.activation == "gelu_tanh" else 0, spec.mixer_called_back, gdn,
                                 ple, L.scalar, shared, gate, L.beside, heads)

    def own_attention(self) -> tuple[tuple[int, ...], bool]:
        """(The layers whose attention the one-call step computes at their own widths (LayerSpec.own_heads), whether
        some other attention layer's mixer is the forward's, called back): asked every decode step, found once."""
        if self._own_attention is None:
            layers = self.config.layers
            self._own_attention = (tuple(i for i, spec in enumerate(layers) if spec.own_heads),
                                   any(spec.mixer_called_back and not spec.own_heads for spec in layers
                                       if spec.linear is None))
        return self._own_attention

    def states_in_c(self) -> bool:
        """Whether every linear-attention layer's mixer runs in C, which writes a step's new state apart from the old
        one (the runner keeps a spare state for it, kv/state.py): asked every step, found once."""
        if self._states_in_c is None:
            linear = [(i, spec) for i, spec in enumerate(self.config.layers) if spec.linear is not None]
            self._states_in_c = bool(linear) and all(self._gdn_table(i, spec) is not None for i, spec in linear)
        return self._states_in_c

    def _gdn_table(self, i: int, spec: LayerSpec):
        """Layer i's Gated DeltaNet mixer in its C form (cpu_quant.gdn_table), made on first use; None off the CPU's
        fp32 path."""
        if i not in self._gdn_tables:
            W, la = self.layers[i].mixer, spec.linear
            self._gdn_tables[i] = None if self.device != "cpu" or self.dtype != torch.float32 else \
                cpu_quant.gdn_table(W.conv, W.A, W.dt_bias, W.norm, la.key_heads, la.key_dim)
        return self._gdn_tables[i]

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden] in the model dtype, times the description's embedding scale (Gemma: sqrt(hidden))."""
        x = self.table.rows(token_ids).to(self.dtype)
        return x if self.config.embed_scale == 1.0 else x * self.config.embed_scale

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        """The description's final soft-cap: cap * tanh(logits / cap) (Gemma 2); None leaves them as they are."""
        cap = self.config.final_softcap
        if cap is None or (not kernels.gpu_path(logits) and cpu_quant.softcap_(logits, cap)):
            return logits                       # in place in C on the CPU (the logits are the step's own)
        return torch.tanh(logits / cap) * cap

    def _split_qkv(self, qkv: torch.Tensor, heads: int | None = None, kv_heads: int | None = None,
                   head_dim: int | None = None):
        """[T, (Hq + 2 Hkv) D] -> views q [T, Hq, D], k and v [T, Hkv, D] (the model's heads, or the given)."""
        c = self.config
        H, KV, D = heads or c.num_heads, kv_heads or c.num_kv_heads, head_dim or c.head_dim
        T, q_size, kv_size = qkv.shape[0], H * D, KV * D
        return (qkv[:, :q_size].view(T, H, D), qkv[:, q_size:q_size + kv_size].view(T, KV, D),
                qkv[:, q_size + kv_size:].view(T, KV, D))

    def kernel_layers(self):
        """The decoder layers as one table for cpu_step.decode_layers (built once), or None where that kernel
        does not cover this model: weights not all packed, a bias it cannot read, 16-bit activations, another device."""
        if not self._kernel_checked:
            self._kernel_checked = True
            if self.device == "cpu" and not kernels.gpu_path(self.device) and self.dtype == torch.float32 \
                    and cpu_quant.available() and self.config.fused_kernel_ok:
                rows = []
                for L in self.layers:
                    row = self._kernel_row(L, self.config.layers[len(rows)], len(rows))
                    if row is None:
                        break
                    rows.append(row)
                else:
                    self._kernel_layers = cpu_step.layer_table(rows)
                    # the layers whose Gated DeltaNet runs in C: all of the model's, or none (the states' indices)
                    gdn = [i for i, row in enumerate(rows) if row.gdn is not None]
                    self._gdn_layers = gdn if len(gdn) == sum(s.linear is not None for s in self.config.layers) else []
        return self._kernel_layers

    @property
    def gdn_layers(self) -> list[int]:
        """The layers whose Gated DeltaNet the one-call step runs in C (given their states): every linear-attention
        layer of the model, or none; known once kernel_layers() has run."""
        return self._gdn_layers

    @torch.inference_mode()
    def forward_decode(self, token_ids: torch.Tensor, attention: Attention | None = None,
                       kernel: DecodeKernel | None = None) -> torch.Tensor | None:
        """One decode token for each of B sequences through every layer in one kernel call (see
        cpu_step.decode_layers), then the output head -> logits [B, vocab]; the same bits as forward() with
        rows = all and num_decode = B. Either `attention`, forward()'s callback, called from the kernel for each
        layer, or `kernel`, an attention backend's whole step (its attention inside the kernel). None where the
        kernel does not cover this model (kernel_layers)."""
        table = self.kernel_layers()
        c = self.config
        if table is None:
            return None
        x = self._embed(token_ids).contiguous()
        per_layer = self._per_layer_inputs(token_ids, x, x.shape[0])
        ple = None if per_layer is None else per_layer.float().contiguous()
        if kernel is not None:
            kernel.run(table, x, ple)
        else:
            def attend(layer, qkv):
                spec = c.layers[layer]
                if spec.linear is not None:     # the layer's Gated DeltaNet (nothing keeps a view of qkv)
                    return self._linear_mixer(layer, self.layers[layer], spec, qkv, attention)
                # a copy: the kernel's buffer outlives no call, so nothing may keep a view of it
                qkv = qkv.clone()
                if spec.mixer_called_back:      # the attention's own split, norms and output gate
                    o = self._attend(layer, self.layers[layer], spec, qkv, attention)
                    return o.reshape(o.shape[0], -1).to(self.dtype)
                return attention(layer, *self._split_qkv(qkv)).to(self.dtype)
            states = attention.kernel_states(self._gdn_layers) if self._gdn_layers else None
            cpu_step.decode_layers(table, x, c.rms_norm_eps, c.num_heads, c.num_kv_heads, c.head_dim, [attend],
                                   states=states, ple=ple)
        return self._capped(self.lm_head.fused(x, norm=self.norm, eps=c.rms_norm_eps, split=x.shape[0]).float())

    def count_experts(self, on: bool = True) -> None:
        """Count, from 0, the tokens each routed layer sends to each expert (expert_counts), or stop counting. Nothing
        for a dense model."""
        for L in self.layers:
            if L.mlp is not None:
                L.mlp.count(on)

    def expert_counts(self) -> tuple[tuple[int, ...] | None, ...]:
        """Per layer, the tokens sent to each expert since count_experts() (None for a dense layer, or one not
        counting); () for a dense model. Every step of the model counts, whichever conversation it serves."""
        if all(L.mlp is None for L in self.layers):
            return ()
        counts = [None if L.mlp is None else L.mlp.counts() for L in self.layers]
        return tuple(None if c is None else tuple(int(n) for n in c.tolist()) for c in counts)

    def weight_bytes(self) -> int:
        """Bytes the weights hold resident: packed codes, scales, norms and the embedding table."""
        ple = list(self.per_layer[:2]) if self.per_layer is not None else []
        linears = [self.table, self.lm_head] + ple + [p for L in self.layers for p in L.linears()]
        norms = [self.norm] + [t for L in self.layers for t in L.norms()] + (
            [self.per_layer[2]] if self.per_layer is not None else [])
        total = sum(lin.nbytes for lin in {id(x): x for x in linears}.values())
        return total + sum(t.numel() * t.element_size() for t in norms)

    def token_read_bytes(self) -> int:
        """Bytes of the weights one decode token reads: all of them but the routed experts it is not sent to (each
        routed layer's experts times (count - used) / count, on average) and an embedding table's other rows (a
        token reads its own row; a table tied to the output head is read whole there). What a weight read rate
        divides: the resident bytes overstate a mixture of experts' reads by up to count / used."""
        total = self.weight_bytes()
        for L in self.layers:
            if L.mlp is not None:
                ex = L.mlp
                experts = sum(lin.nbytes for lin in ex.gate + ex.up + ex.down)
                total -= experts * (ex.spec.count - ex.spec.used) // ex.spec.count
        tables = ([self.table] if self.table is not self.lm_head else []) + (
            [self.per_layer[0]] if self.per_layer is not None else [])
        for t in tables:
            total -= t.nbytes - t.nbytes // t.out_features
        return total

    def _packed(self) -> list:
        from kvchat.engine.model.linears import _Packed
        ple = list(self.per_layer[:2]) if self.per_layer is not None else []
        linears = [self.table, self.lm_head] + ple + [p for L in self.layers for p in L.linears()]
        return [part for lin in linears for part in getattr(lin, "parts", [lin]) if isinstance(part, _Packed)]

    def set_prefill(self, dtype: torch.dtype, fallback: torch.dtype = torch.float32) -> None:
        """The packed linears' prompt-row GEMM: float32 (exact over the dequantized weights), bfloat16, or int8 (the
        kinds gemm8 reads: 4-, 5-, 6-bit and Q8_0 codes; the others, MXFP4 and dense, take `fallback`). The output
        head keeps float32: the bf16 GEMM rounds each output to bf16, and logits near 25 rounded to steps of 0.125
        tie (the default model's first answer token on a Zen 4: 'The' and 'L' 0.11 apart, equal in bf16, so the
        torch path's greedy reply began with the other)."""
        head = {id(part) for part in getattr(self.lm_head, "parts", [self.lm_head])}
        for part in self._packed():
            part.prefill_dtype = torch.float32 if id(part) in head else \
                fallback if dtype == torch.int8 and not part.int8_rows else dtype

    def set_activations(self, bits: int) -> None:
        """The packed linears' decode activations in the C kernels: 16 (int16 per group of 32, exact to about
        1e-5) or 8 (int8, as llama.cpp's Q8_0; weights in groups of 16 keep int16). The one-call step's table is
        built again with them."""
        for part in self._packed():
            part.act_bits = bits
        for L in self.layers:
            if L.mlp is not None:
                L.mlp.reset_kernel()
        self._kernel_layers, self._kernel_checked = None, False

    def linear_kinds(self) -> dict[str, int]:
        """Packed kind -> number of linears, e.g. {"int4": 120, "int8": 1}."""
        from collections import Counter
        return dict(Counter(p.kind for L in self.layers for p in L.linears()) + Counter([self.lm_head.kind]))


def _gelu_times(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(g) * p (Gemma 4's per-layer input gate): in C on the CPU in fp32 (gelu_gate_rows over (g | p)
    pairs, the one-call step's own), torch elsewhere."""
    if not kernels.gpu_path(g) and g.dtype == p.dtype == torch.float32:
        out = cpu_quant.gelu_gate(torch.cat((g, p), dim=1))
        if out is not None:
            return out
    return F.gelu(g, approximate="tanh") * p


def _post_add(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x + RMSNorm(y) * w (a post-norm and its residual): in C on the CPU in fp32 (the one-call step's own
    norm_add_rows, in place on y, a fresh output), so the two paths give the same bits; torch elsewhere."""
    if not kernels.gpu_path(y) and cpu_quant.norm_add_(y, x.contiguous(), w, eps):
        return y
    return x + rms_norm(y, w, eps)
