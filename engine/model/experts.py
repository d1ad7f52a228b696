"""A mixture-of-experts MLP over packed experts: only the experts a token is routed to are read.

A GGUF stores each expert matrix of a layer as one 3-D tensor with the expert as its slowest dimension, so expert
e is rows e * out .. (e + 1) * out of the packed 2-D form the loader makes of it: `expert_views` cuts a packed (or
dense) linear into one linear per expert without copying a byte, and the decode kernels read exactly the k routed
slabs per token. Older Mixtral GGUFs store one tensor per expert: those are one linear each to begin with.

Routing is the description's (engine/model/spec.py: Experts): softmax over every router logit (plus its bias),
the top `used` kept and, where `normalize`, renormalized. Prompt rows are grouped by expert, each group one call
of that expert's linears; the decode rows of a step (the first `split`) go through the C kernels whatever their
group's size (all of them in one call of moe_rows, kernels/cpu_moe.h, where the experts are packed), so that a
token's numbers never depend on what it was batched with.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvchat import kernels
from kvchat.kernels import cpu_quant

from kvchat.engine.model.linears import DenseLinear, Q4Linear, Q8Linear, rms_norm
from kvchat.engine.model.spec import Experts


KERNEL_GROUP_ROWS = 32      # an expert's prompt rows up to this many go through the packed kernels, not the GEMM
_ACTS = {"silu": 0, "swiglu_oai": 1, "gelu_tanh": 2}     # Experts.activation -> the C kernels' act


def expert_views(linear, count: int) -> list:
    """One linear per expert from a linear over `count` experts' rows stacked [count * out, in]: views of its codes,
    scales or weights (nothing copied). A kind that cannot be cut is a ValueError."""
    n = linear.out_features
    if n % count:
        raise ValueError(f"{n} rows are not {count} experts' worth")
    out = n // count
    views = []
    for e in range(count):
        lo, hi = e * out, (e + 1) * out
        if isinstance(linear, DenseLinear):
            views.append(DenseLinear(linear.weight[lo:hi]))
        elif isinstance(linear, (Q4Linear, Q8Linear)):
            views.append(type(linear)(linear.codes[lo:hi], linear.scales.rows(lo, hi)))
        elif hasattr(linear, "expert_view"):           # another packed kind says how it is cut
            views.append(linear.expert_view(lo, hi))
        else:
            raise ValueError(f"a {type(linear).__name__} cannot be cut into experts")
        views[-1].act_bits = getattr(linear, "act_bits", 16)
    return views


def _router_part(router) -> list | None:
    """The router as moe_layer_rows reads it: packed, or float32 rows (bits 32), as a GGUF keeps ffn_gate_inp; its
    bias is the table's router_bias, none of its own."""
    if getattr(router, "bias", None) is not None:
        return None
    if isinstance(router, DenseLinear):
        w = router.weight
        if w.dtype != torch.float32 or w.device.type != "cpu":
            return None
        return [cpu_quant.QLin(w.data_ptr(), None, None, None, None, 32, 0, 1, 32, w.shape[0], w.shape[1], 16)]
    return router.kernel_parts()


class RoutedMLP:
    """A layer's routed MLP: router [experts, hidden] (+ bias), and per expert gate, up [ffn, hidden] and down
    [hidden, ffn] linears (+ biases [experts, ffn] / [experts, hidden])."""

    def __init__(self, spec: Experts, router, router_bias: torch.Tensor | None, gate: list, up: list, down: list,
                 gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None):
        if not len(gate) == len(up) == len(down) == spec.count:
            raise ValueError(f"{len(gate)} / {len(up)} / {len(down)} experts' linears for {spec.count} experts")
        self.spec, self.router, self.router_bias = spec, router, router_bias
        self.gate, self.up, self.down = gate, up, down
        self.gate_bias, self.up_bias, self.down_bias = gate_bias, up_bias, down_bias
        self.hits: torch.Tensor | None = None      # [experts] int64: tokens routed to each, counted when not None
        # Experts.beside_dense (Gemma 4): the router reads rms_norm(x) * router_scale (the learned vector times
        # hidden ** -0.5), and each chosen weight is multiplied by expert_scale [experts]
        self.router_scale: torch.Tensor | None = None
        self.expert_scale: torch.Tensor | None = None
        self._table, self._table_checked = None, False

    def route(self, x: torch.Tensor, split: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] (normed) -> (weights [T, used] float32, experts [T, used] int64); split as in fused()."""
        logits = self.router(x, split=split).float()
        if self.router_bias is not None:
            logits = logits + self.router_bias.float()
        probs = logits.softmax(-1)
        weights, experts = probs.topk(self.spec.used, dim=-1)
        if self.spec.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.expert_scale is not None:
            weights = weights * self.expert_scale[experts]
        return weights, experts

    def _act(self, e: int, x: torch.Tensor, split: int | None) -> torch.Tensor:
        """Expert e's gated activation of rows x -> [rows, ffn]."""
        s = self.spec
        gate = self.gate[e](x, split=split)
        up = self.up[e](x, split=split)
        if self.gate_bias is not None:
            gate, up = gate + self.gate_bias[e], up + self.up_bias[e]
        if s.activation == "silu":
            return F.silu(gate) * up
        if s.activation == "gelu_tanh":
            return F.gelu(gate, approximate="tanh") * up
        gate = gate.clamp(max=s.limit)                 # gpt-oss: clamped, then gate * sigmoid(alpha gate) * (up + 1)
        up = up.clamp(-s.limit, s.limit)
        return gate * torch.sigmoid(gate * s.alpha) * (up + 1)

    def kernel_table(self) -> cpu_quant.ExpertTable | None:
        """The routed MLP as the C kernels read it (built once): moe_layer_rows for a step's decode rows, and
        decode_layers' layer table; None where the router or an expert is of a kind the kernels do not read."""
        if not self._table_checked:
            self._table_checked = True
            experts = (self.gate, self.up, self.down)
            own_bias = any(getattr(lin, "bias", None) is not None for g in experts for lin in g)   # the table's are
            groups = [[_router_part(self.router)]] + [[lin.kernel_parts() for lin in group] for group in experts]
            scales = [t for t in (self.router_scale, self.expert_scale) if t is not None]
            if cpu_quant.available() and not own_bias and all(t.device.type == "cpu" for t in scales) \
                    and all(p is not None and len(p) == 1 for group in groups for p in group):
                s = self.spec
                router, gate, up, down = ([p[0] for p in group] for group in groups)
                self._table = cpu_quant.ExpertTable(router[0], gate, up, down, self.router_bias,
                                                    (self.gate_bias, self.up_bias, self.down_bias), s.used,
                                                    s.normalize, _ACTS[s.activation], s.alpha, s.limit,
                                                    self.router_scale, self.expert_scale)
                self._table.counting(self.hits is not None)
        return self._table

    def reset_kernel(self) -> None:
        """Build kernel_table again (the linears' activation bits changed)."""
        self._table, self._table_checked = None, False

    def count(self, on: bool) -> None:
        """Count the tokens routed to each expert from now on (hits, from 0), or stop counting (hits None)."""
        self.hits = torch.zeros(self.spec.count, dtype=torch.long) if on else None
        if self._table is not None:
            self._table.hits = torch.zeros(self.spec.count, dtype=torch.long)
            self._table.counting(on)

    def counts(self) -> torch.Tensor | None:
        """Tokens routed to each expert since count(True): both paths' counts, or None when not counting."""
        if self.hits is None:
            return None
        return self.hits + (self._table.hits if self._table is not None else 0)

    def fused(self, x: torch.Tensor, norm: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
              split: int | None = None) -> torch.Tensor:
        """residual (where given) + the routed MLP of rms_norm(x) ([T, hidden]). split: how many leading rows are
        decode rows (see linears._Packed.fused); None: all of them up to MAX_ROWS rows, else none. Decode rows run
        in one moe_layer_rows call where the kernels read the router and experts (the call decode_layers makes for
        the layer, so the two give the same bits); prompt rows, and every row where the kernels do not read them,
        grouped by expert through the linears."""
        dtype = x.dtype
        T = x.shape[0]
        split = cpu_quant.decode_split(T, split)
        table = None if kernels.gpu_path(x) or x.dtype != torch.float32 else self.kernel_table()
        res = None if residual is None else residual.float()
        parts = []
        if table is not None and split:
            parts.append(cpu_quant.moe_layer(x[:split], norm, eps, table, None if res is None else res[:split]))
            if split == T:
                return parts[0]
            x, res, split = x[split:], None if res is None else res[split:], 0
        xn = rms_norm(x, norm, eps).float()
        weights, experts = self.route(xn if self.router_scale is None else rms_norm(x, self.router_scale, eps).float(),
                                      split)
        if self.hits is not None:
            self.hits += torch.bincount(experts.reshape(-1).cpu(), minlength=self.spec.count)
        parts.append(self._grouped(xn, weights, experts, split, res))
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).to(dtype)

    def _grouped(self, xn, weights, experts, split: int, res) -> torch.Tensor:
        """Rows grouped by expert, each group one call of its expert's linears (decode rows, the first `split`,
        first in each group: the kernel reads them, as in a dense layer); added in ascending expert order."""
        T = xn.shape[0]
        out = torch.zeros_like(xn)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)       # rows grouped by expert, each group in row order
        counted = torch.bincount(flat, minlength=self.spec.count)
        counts = counted.tolist()
        tokens = order // self.spec.used
        slots = order % self.spec.used
        table = None if split or kernels.gpu_path(xn) else self.kernel_table()
        if table is not None:
            # every small group's prompt rows in one C call (the kernels the loop below would call, without a
            # Python step per expert: 256 experts of a few rows each made the loop the prompt's cost); the large
            # groups go through the GEMM below
            small = counted <= KERNEL_GROUP_ROWS
            pick = small[flat[order]]
            cpu_quant.moe_grouped(xn, tokens[pick].int(), torch.where(small, counted, 0).int(),
                                  weights[tokens[pick], slots[pick]].float(), table, out)
            counts = [n if n > KERNEL_GROUP_ROWS else 0 for n in counts]
            keep = ~pick
            tokens, slots = tokens[keep], slots[keep]
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            rows, which = tokens[start:start + n], slots[start:start + n]
            start += n
            # decode rows through the kernel; so are a small group's prompt rows (reading the packed slab a few rows
            # at a time costs less than dequantizing it for the GEMM); a large group's through the GEMM
            part = n if n <= KERNEL_GROUP_ROWS else int((rows < split).sum())
            y = self.down[e](self._act(e, xn.index_select(0, rows), part), split=part)
            if self.down_bias is not None:
                y = y + self.down_bias[e]
            out.index_add_(0, rows, y * weights[rows, which].unsqueeze(-1))
        return out if res is None else res + out

    def linears(self) -> list:
        return [self.router] + self.gate + self.up + self.down

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.router_bias, self.gate_bias, self.up_bias, self.down_bias, self.router_scale,
                            self.expert_scale) if t is not None]

    def moved(self, device) -> "RoutedMLP":
        move = lambda t: None if t is None else t.to(device)     # noqa: E731
        self.router = self.router.moved(device)
        self.gate = [lin.moved(device) for lin in self.gate]
        self.up = [lin.moved(device) for lin in self.up]
        self.down = [lin.moved(device) for lin in self.down]
        self.router_bias, self.gate_bias = move(self.router_bias), move(self.gate_bias)
        self.router_scale, self.expert_scale = move(self.router_scale), move(self.expert_scale)
        self.up_bias, self.down_bias = move(self.up_bias), move(self.down_bias)
        return self
