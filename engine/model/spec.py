"""What one decoder layer computes, in data: the description the torch forward, the one-call C step and the
torch-free one-shot path all read; no torch here.

A family (engine/model/families.py) turns a config.json or a GGUF header into one LayerSpec per layer. A
Llama-family layer is the default LayerSpec with its biases; the fields past that are the ways the
families of issue 23 differ (Gemma 2 / 3, Qwen3, Phi-3), so that adding one is a new row in the
registry and a reader of the new fields, never a new kind of config.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# the gated MLP's activation on the gate: SwiGLU (Llama, Qwen, Phi-3) or GELU with the tanh approximation (Gemma)
ACTIVATIONS = ("silu", "gelu_tanh")
# an expert's activation: SwiGLU, or gpt-oss's clamped one (gate clamped above at `limit`, up to [-limit, limit],
# gate * sigmoid(alpha * gate) * (up + 1))
EXPERT_ACTIVATIONS = ("silu", "swiglu_oai", "gelu_tanh")


@dataclass(frozen=True, slots=True)
class Rope:
    """Rotary embedding of one layer: base, scaling and how many dimensions of each head turn.

    scaling: () none; ("linear", factor, 0.0, 0.0, 0); ("llama3", factor, low_freq_factor, high_freq_factor,
    original_max); ("factors", (divisor, ...)): one divisor per frequency, a GGUF's rope_freqs tensor or
    LongRoPE's short or long factors (Phi-3); ("yarn", factor, beta_fast, beta_slow, original_max, truncate):
    YaRN's blend of interpolated and extrapolated frequencies (gpt-oss; its attention factor, like LongRoPE's,
    is folded into LayerSpec.query_scale); ("nope",): a layer that does not rotate at all (SmolLM3's every fourth
    layer): every frequency 0, so cos 1 and sin 0 and the rotation is exactly the identity, through the same
    per-layer tables as any other rope.
    ("proportional", fraction): Gemma 4's global layers: the first fraction * head_dim / 2 pairs turn at
    theta ** (-2i / head_dim) (the whole head's exponents, not the rotated part's), the rest at frequency 0, in the
    whole-head rotate-half layout (transformers' _compute_proportional_rope_parameters).
    LongRoPE (Phi-3 / Phi-4-mini) has two sets: the short factors for positions up to
    original_max_position_embeddings, the long ones past it. transformers switches the whole sequence (every key
    already cached included) to the long ones once it passes that length, which a cache of rotated keys cannot
    follow; as llama.cpp, which picks one set for the whole run by its context size, ModelConfig.for_context picks
    one by the context the cache is configured for (the short ones as read). Its attention factor is not a rope
    setting: the family folds it into LayerSpec.query_scale.
    dims: the rotated leading dimensions of a head (Phi-4-mini's partial rotary factor); None: all of them.
    """
    theta: float
    scaling: tuple = ()
    dims: int | None = None

    def table(self, head_dim: int) -> np.ndarray:
        """[head_dim / 2] float32: frequencies() where every dimension turns; for a partial rotation, the rotated
        pairs' frequencies then zeros (pairs that do not turn: cos 1, sin 0, the identity). Read together with
        permutation(): every kernel then rotates a whole head in the rotate-half layout, partial or not."""
        inv = self.frequencies(head_dim)
        if self.dims is None or self.dims == head_dim:
            return inv
        return np.concatenate((inv, np.zeros((head_dim - self.dims) // 2, dtype=np.float32)))

    def permutation(self, head_dim: int) -> np.ndarray | None:
        """The order of a head's dimensions that makes a partial rotation a whole-head one, or None (all turn).

        A partial rotation turns pairs (i, i + dims/2) of the first `dims` dimensions and passes the rest through;
        the kernels turn pairs (i, i + head_dim/2). Queries and keys both taken in this order put each rotated pair
        at (i, i + head_dim/2) and the passed-through dimensions at the zero frequencies of table(): q . k is a sum
        over dimensions, so the order changes no score, and values are not reordered."""
        d = self.dims
        if d is None or d == head_dim:
            return None
        r, p, half = d // 2, (head_dim - d) // 2, head_dim // 2
        order = np.empty(head_dim, dtype=np.int64)
        order[:r], order[half:half + r] = np.arange(r), np.arange(r, d)
        order[r:half], order[half + r:] = np.arange(d, d + p), np.arange(d + p, head_dim)
        return order

    def frequencies(self, head_dim: int) -> np.ndarray:
        """[rotated dims / 2] float32 inverse frequencies: computed in float64, rounded to float32 once. The
        table every RoPE (Python, C) turns with: position p rotates pair i (i, i + half) by p * inv[i]."""
        d = self.dims or head_dim
        if self.scaling and self.scaling[0] == "proportional":
            turned = int(self.scaling[1] * head_dim // 2)
            inv = np.zeros(head_dim // 2, dtype=np.float64)
            inv[:turned] = 1.0 / (self.theta ** (np.arange(0, 2 * turned, 2, dtype=np.float64) / head_dim))
            return inv.astype(np.float32)
        inv = 1.0 / (self.theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        if self.scaling == ("nope",):
            return np.zeros(d // 2, dtype=np.float32)
        if self.scaling:
            kind, factor = self.scaling[:2]
            if kind == "yarn":
                inv = _yarn(inv, d, self.theta, *self.scaling[1:])
            elif kind == "linear":
                inv = inv / factor
            elif kind == "factors":
                inv = inv / np.asarray(factor, dtype=np.float64)
            else:  # llama3: long wavelengths slowed by `factor`, short kept, smooth in between
                low, high, orig = self.scaling[2:]
                wavelen = 2 * math.pi / inv
                low_wl, high_wl = orig / low, orig / high
                smooth = (orig / wavelen - low) / (high - low)
                scaled = np.where(wavelen > low_wl, inv / factor, inv)
                mid = (wavelen <= low_wl) & (wavelen >= high_wl)
                inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
        return inv.astype(np.float32)


@dataclass(frozen=True, slots=True)
class Experts:
    """A layer's MLP as a mixture of experts: a router picks `used` of `count` experts per token, and the token's
    MLP output is the experts' outputs weighted by the router's probabilities.

    Routing: softmax over all `count` router logits (plus the router's bias where router_bias), the top `used`
    kept; normalize: those renormalized to sum to 1 (Mixtral and gpt-oss always, Qwen3-MoE by norm_topk_prob;
    softmax over the selected logits alone, as gpt-oss writes it, is the same numbers). Each expert is a gated
    MLP of intermediate size `ffn`: down(act(gate(x)) * up(x)), with biases on gate, up and down where
    expert_bias (gpt-oss). activation: one of EXPERT_ACTIVATIONS; alpha, limit: swiglu_oai's constants.
    shared_ffn: a shared expert of that intermediate size that every token goes through, its output scaled by
    sigmoid(shared_expert_gate . x) and added (Qwen3.5-MoE); 0: none.
    beside_dense: the experts run beside the layer's dense MLP (Gemma 4): each output normed on its own, their sum
    normed again; the router reads the layer's input RMS-normed times a learned vector (and hidden ** -0.5), and
    each chosen expert's renormalized weight is multiplied by that expert's learned scale.
    """
    count: int
    used: int
    ffn: int
    normalize: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    shared_ffn: int = 0
    beside_dense: bool = False

    def __post_init__(self):
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"expert activation {self.activation!r}: one of {', '.join(EXPERT_ACTIVATIONS)}")
        if not 0 < self.used <= self.count:
            raise ValueError(f"{self.used} experts used per token of {self.count}")


@dataclass(frozen=True, slots=True)
class LinearAttention:
    """A layer whose token mixer keeps a fixed-size state instead of a KV cache: Gated DeltaNet (Yang et al. 2024,
    as Qwen3.5 / 3.6 use it, transformers' Qwen3_5GatedDeltaNet).

    Per token: one projection gives q, k (key_heads x key_dim each) and v (value_heads x value_dim) through a causal
    depthwise convolution of conv_kernel taps and SiLU, the output gate z, and per value head b and a; q and k are
    L2-normalized, q scaled by key_dim ** -0.5; beta = sigmoid(b) and the decay g = A * softplus(a + dt_bias) (A < 0).
    Each value head h keeps a key_dim x value_dim matrix S: S <- exp(g) S; S <- S + k (beta (v - k S)); o = q S
    (the gated delta rule; key head h // (value_heads / key_heads) serves value head h). The output is
    RMSNorm(o) * w * silu(z) per value head, then out_proj.

    State per sequence: the convolution's last conv_kernel - 1 inputs of every channel and S of every value head,
    the same size at any length."""
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    def __post_init__(self):
        if self.value_heads % self.key_heads:
            raise ValueError(f"{self.value_heads} value heads do not share {self.key_heads} key heads evenly")
        if self.conv_kernel < 1:
            raise ValueError(f"a convolution of {self.conv_kernel} taps")

    @property
    def channels(self) -> int:
        """The convolution's channels: q, k and v."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def conv_floats(self) -> int:
        return self.channels * (self.conv_kernel - 1)

    @property
    def state_floats(self) -> int:
        return self.value_heads * self.key_dim * self.value_dim

    @property
    def state_bytes(self) -> int:
        """One sequence's state in this layer, float32: the convolution's tail and the delta rule's matrices."""
        return 4 * (self.conv_floats + self.state_floats)


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One decoder layer: x += o(attend(qkv(norm(x)))); x += down(act(gate) * up(norm(x))).

    norm_offset: every RMSNorm of the layer scales by (norm_offset + w): 0 for Llama, 1 for Gemma's (1 + w).
    post_norms: a norm also after attention and after the MLP, before each residual add (Gemma 2 / 3).
    activation: one of ACTIVATIONS.
    qk_norm: a per-head RMSNorm of q and of k before RoPE (Qwen3, Gemma 3).
    window: a sliding layer: the query at absolute position p attends the keys at positions p - window < k <= p
        (`window` keys, itself included), as transformers' sliding mask and llama.cpp's SWA do; None: every key.
    query_scale: what q . k is multiplied by before the softmax: head_dim ** -0.5, Gemma's
        query_pre_attn_scalar ** -0.5, or head_dim ** -0.5 times the square of LongRoPE's attention factor.
    attn_softcap: scores become cap * tanh(scores / cap) before the softmax (Gemma 2); None: not capped.
    qkv_bias / o_bias / mlp_bias: the projections with a bias (Qwen2: q, k and v).
    sink_logits: the layer has learned per-head sink logits (gpt-oss): one extra logit per query head that joins
        the softmax's denominator and takes mass without a value (the weights hold them, [num_heads] float32).
        Not to be confused with the cache's StreamingLLM sinks (CacheConfig.sinks), which are tokens.
    experts: the MLP is a mixture of experts (Experts); None: one dense gated MLP.
    linear: the layer's token mixer is linear attention with a recurrent state (LinearAttention), not softmax
        attention over a KV cache: its `kind` is "linear_attention", and the attention fields above do not apply.
    attn_gate: the attention output is multiplied by sigmoid of a per-head gate before o_proj (Qwen3.5: q_proj
        gives each head's query and its gate).
    head_dim / kv_heads: the layer's own head size and KV head count where they differ from the model's (Gemma 4's
        global layers: heads of 512 beside the sliding layers' 256); None: the model's.
    kv_source: the layer keeps no K and V of its own and attends over layer `kv_source`'s (an earlier layer of the
        same kind: Gemma 4's last num_kv_shared_layers layers); its own projection is q only. None: its own KV.
    value_norm: v is RMS-normalized per head (no multiplier) before it is stored (Gemma 4).
    value_from_key: the layer has no v_proj; v is k_proj's output before the key norm (Gemma 4's attention_k_eq_v).
    ffn: the layer's MLP intermediate size where it differs from the model's (Gemma 4's double-wide MLP); None.
    output_scale: the layer's output (the residual stream after it) is multiplied by a learned scalar (Gemma 4's
        layer_scalar).
    """
    rope: Rope
    query_scale: float
    norm_offset: float = 0.0
    post_norms: bool = False
    activation: str = "silu"
    qk_norm: bool = False
    window: int | None = None
    attn_softcap: float | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sink_logits: bool = False
    experts: Experts | None = None
    linear: LinearAttention | None = None
    attn_gate: bool = False
    head_dim: int | None = None
    kv_heads: int | None = None
    kv_source: int | None = None
    value_norm: bool = False
    value_from_key: bool = False
    ffn: int | None = None
    output_scale: bool = False

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r}: one of {', '.join(ACTIVATIONS)}")

    @property
    def kind(self) -> str:
        """"attention" (softmax attention over the layer's KV cache) or "linear_attention" (a recurrent state)."""
        return "attention" if self.linear is None else "linear_attention"

    @property
    def own_kv(self) -> bool:
        """Whether the layer keeps K and V in the cache: softmax attention over its own keys, not another layer's."""
        return self.linear is None and self.kv_source is None

    @property
    def plain_qk_rows(self) -> bool:
        """Whether q and k are plain rows of the layer's projection, q's heads then k's (no output gate between, no
        other layer's KV, no values made from keys): where a partial rotation's order can be the weights' own."""
        return (self.linear is None and not self.attn_gate and self.kv_source is None and not self.value_from_key
                and not self.value_norm)

    @property
    def order_in_weights(self) -> bool:
        """Whether a partial rotation's order can be the projection's own rows (Transformer takes the rows so): q and
        k plain rows (plain_qk_rows), or Qwen3.5's gated queries, whose gates the same taking moves aside, between q
        and k."""
        return self.plain_qk_rows or (self.attn_gate and self.linear is None and self.kv_source is None
                                      and not self.value_from_key and not self.value_norm)

    @property
    def mixer_called_back(self) -> bool:
        """Whether the one-call C step's table gives this layer's token mixer its own widths, between its projections:
        the forward's own mixer, called back in Python, where the model's common attention does not compute it (Gemma
        4's heads of the layer's own width and count, KV read from another layer, values normed or taken from the keys,
        its proportional rope: C's own_attention where a C group reads the pages, own_heads; Qwen3.5's output gate
        is C's) or the step has no form of it (a Gated DeltaNet where the step brings no states; with them it runs in
        C)."""
        return (self.linear is not None or (self.attn_gate and not self.order_in_weights)
                or self.head_dim is not None or self.kv_heads is not None
                or self.kv_source is not None or self.value_norm or self.value_from_key
                or self.rope.scaling[:1] == ("proportional",))

    @property
    def own_heads(self) -> bool:
        """Whether the one-call step attends this called-back layer in C itself where a C group reads the layer's
        pages (run_layers' own_attention; StepAttention.decode says where): a softmax attention called back only
        for Gemma 4's reasons (heads of its own width and count, KV read from another layer, values normed or taken
        from the keys, its proportional rope, a whole-head rotation), no output gate."""
        return self.mixer_called_back and self.linear is None and not self.attn_gate and self.rope.dims is None

    @property
    def fused_kernel_ok(self) -> bool:
        """Whether the one-call C step (kernels/cpu_quant.c: decode_layers) computes this layer: RMSNorm before
        attention and MLP (Gemma's (1 + w) is in the loaded weights), Qwen3's and Gemma's q/k norms, Gemma's post-norms
        and GELU-tanh gate with a dense MLP, SwiGLU; Gemma 2's soft-capped scores, biases (lin_apply adds them) and
        sink logits (gpt-oss's), the last two the attention's; a sliding window is the attention's (the callback's, or
        the caller's rows of a one-layout step); a partial rotation where its order is the weights' own (order_in_weights:
        Transformer takes the rows so); Qwen3.5's output gate; a routed MLP (experts) of any kind the description
        has, a shared expert beside it (kernels/cpu_moe.h), or Gemma 4's GELU experts beside its dense MLP; a mixer
        called back (mixer_called_back), with the projections and the MLP in C; an MLP of the layer's own width,
        Gemma 4's per-layer input and layer scalar. Its weights must be packed too, which the linears say
        (kernel_parts)."""
        ex = self.experts
        return (self.activation in ("silu", "gelu_tanh")
                and (ex is None or self.activation == "silu" or ex.beside_dense)
                and (not self.post_norms or ex is None or ex.beside_dense)
                and (self.rope.dims is None or self.order_in_weights or self.mixer_called_back))


def _yarn(inv: np.ndarray, d: int, theta: float, factor: float, beta_fast: float, beta_slow: float,
          original: int, truncate: bool) -> np.ndarray:
    """YaRN (Peng et al. 2023, as transformers' _compute_yarn_parameters computes it): frequencies that turn fewer
    than beta_slow times over the original context are interpolated (divided by factor), those that turn more than
    beta_fast times kept, a linear ramp between."""
    def dim_of(rotations):
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp                                   # the extrapolated (kept) share of each frequency
    return inv / factor * (1 - keep) + inv * keep


def yarn_attention_factor(factor: float) -> float:
    """YaRN's default attention factor (its mscale): 0.1 ln(factor) + 1, 1 for factor <= 1."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def rope_cos_sin_numpy(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [N, D] float32 of positions [N] over a Rope.frequencies table [D/2], in the rotate-half layout
    (frequency i at columns i and i + D/2), angles in float64: engine/model/rope.py's rope_cos_sin for the
    torch-free one-shot path (same arguments, same values: tests/test_families.py holds them equal)."""
    freqs = positions.astype(np.float64)[:, None] * inv_freq.astype(np.float64)[None, :]
    emb = np.concatenate((freqs, freqs), axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
