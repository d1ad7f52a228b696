"""Build the Transformer's weights from a source: a GGUF read in place, or a safetensors state dict.

Weight paths (EngineConfig.weights):
- "auto": a GGUF keeps its own blocks packed (4-bit types as int4 groups of 32, Q6_K as its own 6-bit blocks,
  the other 5-8 bit types as int8 codes, 16-bit as 16-bit); a safetensors folder keeps its stored dtype.
- "dense": every weight dequantized to the model dtype (fp32 on the CPU): the exact reference.
- "int8" / "int4": float weights quantized on load (opt-in, for safetensors folders).
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from kvchat import kernels
from kvchat.kernels.cpu_quant import Scales

from kvchat.engine.gguf.blocks import packed_matrix, unpermute_rows
from kvchat.engine.model import gguf_arch
from kvchat.engine.model.gguf_view import GGUFModel
from kvchat.engine.errors import ModelLoadError
from kvchat.engine.model.config import ModelConfig
from kvchat.engine.model.experts import RoutedMLP, expert_views
from kvchat.engine.model.transformer import Layer, MixerWeights, Transformer
from kvchat.engine.model.config import check_weight_shapes, layer_modules
from kvchat.engine.model.linears import ConcatLinear, DenseLinear, Q4Linear, Q8Linear, cat_bias, quantize_float
from kvchat.engine.model.linears import MXFP4Linear, Q5Linear, Q6Linear

def _assemble(mc: ModelConfig, linear, tensor, dtype, device, weights: str, quant: str = "",
              per_expert=lambda name: None, input_order=lambda name: None, fused_experts=lambda name: None
              ) -> Transformer:
    """linear(names, bias_names) -> a linear (several names: concatenated along the output); tensor(name, offset)
    -> a norm vector holding the multiplier the norm applies, offset + w, where the source stores w (LayerSpec's
    norm_offset: Gemma's (1 + w)). Whether the stored vector is w or already offset + w is the source's to know,
    so each loader's tensor() says which it adds. Module names per family: config.layer_modules. per_expert(name)
    -> the names of one tensor per expert where the source stores a 3-D expert matrix that way (Mixtral's older
    GGUFs), else None: the 3-D tensor is then one linear, cut into its experts without a copy. input_order(name) ->
    the order a linear's input must be taken in, where its columns are stored in another order than the model
    computes (a packed GGUF's out_proj over tiled value heads: columns move only by whole blocks), else None.
    fused_experts(name) -> the name of a 3-D tensor holding the experts' gate and up matrices fused (each expert's
    gate rows, then its up rows: Gemma 4's GGUFs), or None."""
    layers = []
    for i, spec in enumerate(mc.layers):
        p = f"model.layers.{i}."
        modules = layer_modules(mc, spec)

        def lin(part: str, biased: bool):
            names = modules[part]
            return linear([p + m + ".weight" for m in names], [p + m + ".bias" for m in names] if biased else None)

        def norm(part: str) -> torch.Tensor | None:
            names = modules.get(part)
            return None if names is None else tensor(p + names[0] + ".weight", spec.norm_offset)

        mlp = shared = mixer = beside = None
        if spec.experts is not None:
            mlp = _routed(spec.experts, p, linear, tensor, per_expert, fused_experts)
            if spec.experts.beside_dense:
                mlp.router_scale = tensor(p + "mlp.router.scale").float() * mc.hidden_size ** -0.5
                mlp.expert_scale = tensor(p + "mlp.router.per_expert_scale").float()
                beside = (norm("post_mlp_norm_1"), norm("norm_mlp_2"), norm("post_mlp_norm_2"))
            if spec.experts.shared_ffn:
                shared = (lin("shared_gate_up", False), lin("shared_down", False), lin("shared_gate", False))
        o = lin("o", spec.o_bias)              # before the mixer: a packed out_proj decides its input's order
        if spec.linear is not None:
            la = spec.linear
            vec = lambda part: tensor(p + modules[part][0] + (".bias" if part == "dt" else ".weight")).float()  # noqa: E731
            order = input_order(p + "linear_attn.out_proj.weight")
            mixer = MixerWeights(vec("conv").reshape(la.channels, la.conv_kernel).t().contiguous(), vec("dt").reshape(-1),
                                 vec("A").reshape(-1), vec("mixer_norm").reshape(-1),
                                 None if order is None else torch.from_numpy(order).to(device))
        ple = None
        if "ple_gate" in modules:           # per-layer input embeddings (Gemma 4): gate, projection, its norm
            ple = (lin("ple_gate", False), lin("ple_proj", False), norm("ple_norm"))
        layers.append(Layer(
            ple=ple, scalar=tensor(p + "layer_scalar").float().reshape(1) if spec.output_scale else None,
            qkv=lin("qkv", spec.qkv_bias), o=o,
            gate_up=lin("gate_up", spec.mlp_bias) if "gate_up" in modules else None,
            down=lin("down", spec.mlp_bias) if "down" in modules else None, beside=beside,
            norm_attn=norm("norm_attn"), norm_mlp=norm("norm_mlp"),
            q_norm=norm("q_norm"), k_norm=norm("k_norm"),
            post_attn_norm=norm("post_attn_norm"), post_mlp_norm=norm("post_mlp_norm"),
            mlp=mlp, sinks=tensor(p + "self_attn.sinks.weight").float() if spec.sink_logits else None,
            mixer=mixer, shared=shared))
    table = linear(["model.embed_tokens.weight"], None)
    head = table if mc.tie_word_embeddings else linear(["lm_head.weight"], None)
    # the final norm is the family's kind too (Gemma: 1 + w)
    offset = mc.layers[0].norm_offset if mc.layers else 0.0
    per_layer = None
    if mc.per_layer_input:                  # Gemma 4's per-layer input embeddings: table, projection, norm
        per_layer = (linear(["model.embed_tokens_per_layer.weight"], None),
                     linear(["model.per_layer_model_projection.weight"], None),
                     tensor("model.per_layer_projection_norm.weight", offset))
    return Transformer(mc, table, layers, tensor("model.norm.weight", offset), head, dtype, device, weights, quant,
                       per_layer=per_layer)


def _routed(ex, p: str, linear, tensor, per_expert, fused_experts=lambda name: None) -> RoutedMLP:
    """A layer's routed MLP (config.expert_shapes names its tensors): each 3-D expert matrix one linear cut into its
    experts (or one linear per stored expert; gate and up fused: one linear cut into twice as many halves), biases
    [experts, out]."""
    fused = fused_experts(p + "mlp.experts.gate_proj.weight")
    halves = expert_views(linear([fused], None), 2 * ex.count) if fused is not None else None

    def experts(module: str) -> list:
        if halves is not None and module in ("mlp.experts.gate_proj", "mlp.experts.up_proj"):
            return halves[0::2] if module == "mlp.experts.gate_proj" else halves[1::2]
        name = p + module + ".weight"
        names = per_expert(name)
        if names is not None:
            return [linear([n], None) for n in names]
        return expert_views(linear([name], None), ex.count)

    def bias(module: str) -> torch.Tensor | None:
        return tensor(p + module + ".bias").float().reshape(ex.count, -1) if ex.expert_bias else None

    router_bias = tensor(p + "mlp.router.bias").float() if ex.router_bias else None
    return RoutedMLP(ex, linear([p + "mlp.router.weight"], None), router_bias, experts("mlp.experts.gate_proj"),
                     experts("mlp.experts.up_proj"), experts("mlp.experts.down_proj"), bias("mlp.experts.gate_proj"),
                     bias("mlp.experts.up_proj"), bias("mlp.experts.down_proj"))


# ---- safetensors ---------------------------------------------------------------------------------

def expert_state(model_type: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face checkpoint's mixture-of-experts tensors under kvchat's names (config.expert_shapes): per-expert
    2-D tensors stacked into [experts, out, in], fused gate | up split, gpt-oss's [experts, in, 2 x ffn] with gate and
    up interleaved taken apart and turned to [experts, out, in]; gpt-oss's sinks named as a weight. Other tensors
    as they are."""
    out, stacks = {}, {}
    if model_type in ("gemma4_text", "gemma4"):     # router and experts beside the dense MLP, under mlp.
        state = {_gemma4_moe_name(name): t for name, t in state.items()}
    renames = {"block_sparse_moe.gate.": "mlp.router.", "mlp.gate.": "mlp.router.", "block_sparse_moe.": "mlp."}
    per = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj", "gate_proj": "gate_proj", "up_proj": "up_proj",
           "down_proj": "down_proj"}
    for name, t in state.items():
        for old, new in renames.items():
            if old in name:
                name = name.replace(old, new, 1)
                break
        head, sep, rest = name.partition(".mlp.experts.")
        if sep and rest.split(".")[0].isdigit():             # mlp.experts.E.<proj>.weight
            e, proj, kind = rest.split(".")
            stacks.setdefault(f"{head}.mlp.experts.{per[proj]}.{kind}", {})[int(e)] = t
        elif sep and rest in ("gate_up_proj", "gate_up_proj_bias"):
            kind = "bias" if rest.endswith("_bias") else "weight"
            if model_type == "gpt_oss":                   # [E, H, 2F] (bias [E, 2F]), gate and up interleaved
                gate, up = t[..., 0::2], t[..., 1::2]
                if kind == "weight":
                    gate, up = gate.transpose(1, 2), up.transpose(1, 2)
            else:                                         # [E, 2F, H]: gate rows, then up rows
                gate, up = t.chunk(2, dim=1)
            out[f"{head}.mlp.experts.gate_proj.{kind}"] = gate.contiguous()
            out[f"{head}.mlp.experts.up_proj.{kind}"] = up.contiguous()
        elif sep and rest in ("down_proj", "down_proj_bias"):
            kind = "bias" if rest.endswith("_bias") else "weight"
            if model_type == "gpt_oss" and kind == "weight":      # [E, F, H] -> [E, H, F]
                t = t.transpose(1, 2)
            out[f"{head}.mlp.experts.down_proj.{kind}"] = t.contiguous()
        elif name.endswith(".self_attn.sinks"):
            out[name + ".weight"] = t
        else:
            out[name] = t
    for name, by_expert in stacks.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ModelLoadError(f"the checkpoint's experts of {name} skip a number: it is incomplete")
        out[name] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def linear_state(state: dict[str, torch.Tensor]) -> None:
    """A Hugging Face checkpoint's linear-attention tensors under kvchat's names (config.linear_shapes), in place:
    A_log becomes A = -exp(A_log) (the decay rate the forward multiplies by), dt_bias the bias dt.bias, the depthwise
    conv1d [channels, 1, kernel] a [channels, kernel] matrix."""
    for name in [n for n in state if ".linear_attn." in n]:
        t = state[name]
        if name.endswith(".A_log"):
            state[name[:-len("A_log")] + "A.weight"] = -torch.exp(state.pop(name).float())
        elif name.endswith(".dt_bias"):
            state[name[:-len("dt_bias")] + "dt.bias"] = state.pop(name)
        elif name.endswith(".conv1d.weight") and t.dim() == 3:
            state[name] = t.reshape(t.shape[0], t.shape[-1])


def _gemma4_moe_name(name: str) -> str:
    """Gemma 4's layers.N.router.{proj.weight, scale, per_expert_scale} and layers.N.experts.* under mlp."""
    if ".router.proj." in name:
        return name.replace(".router.proj.", ".mlp.router.")
    if ".router." in name or ".experts." in name:
        return name.replace(".router.", ".mlp.router.").replace(".experts.", ".mlp.experts.")
    return name


def from_state_dict(mc: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device: str,
                    weights: str) -> Transformer:
    linear_state(state)
    if any(spec.experts is not None or spec.sink_logits for spec in mc.layers):
        if any(name.endswith(("_blocks", "_scales")) for name in state):
            raise ModelLoadError("this checkpoint stores its experts as MXFP4 blocks in safetensors, which kvchat does "
                                 "not read: use the model's GGUF (it keeps MXFP4 packed)")
        moved = expert_state(mc.model_type, state)
        state.clear()
        state.update(moved)
    check_weight_shapes(mc, {name: tuple(t.shape) for name, t in state.items()}, "config.json", {})
    if mc.tie_word_embeddings or "lm_head.weight" not in state:
        mc = _tied(mc)

    def get(name: str) -> torch.Tensor:
        t = state.get(name)
        if t is None:
            raise ModelLoadError(f"weight {name} is missing: the checkpoint does not match its config.json")
        return t

    stored = get("model.embed_tokens.weight").dtype
    # the stored dtype stays on the CPU when it is 16-bit (bf16 runs on AVX512-BF16 where present)
    keep16 = weights == "auto" and device == "cpu" and stored in (torch.bfloat16, torch.float16)
    wdtype = stored if keep16 else dtype

    def tensor(name: str, offset: float = 0.0) -> torch.Tensor:
        # a Hugging Face folder stores a Gemma norm as w: the multiplier 1 + w is made here, in fp32 as HF does
        t = get(name)
        return (t.float() + offset if offset else t).to(device=device, dtype=dtype)

    def linear(names, bias_names):
        w = torch.cat([get(n) for n in names], 0) if len(names) > 1 else get(names[0])
        if w.dim() == 3:                  # experts [E, out, in]: one linear over their rows, cut by _routed
            w = w.reshape(-1, w.shape[-1])
        b = cat_bias([tensor(n) for n in bias_names]) if bias_names else None
        if weights in ("int8", "int4"):
            return quantize_float(w, b, weights)
        return DenseLinear(w.to(device=device, dtype=wdtype), b)

    label = weights if weights != "auto" else {torch.float32: "fp32", torch.bfloat16: "bf16",
                                               torch.float16: "fp16"}.get(wdtype, "dense")
    model = _assemble(mc, linear, tensor, dtype, device, label)
    state.clear()
    return model


def _tied(mc: ModelConfig) -> ModelConfig:
    from dataclasses import replace
    return replace(mc, tie_word_embeddings=True)


# ---- GGUF ----------------------------------------------------------------------------------------

def from_gguf(mc: ModelConfig, gf: GGUFModel, dtype: torch.dtype, device: str, weights: str) -> Transformer:
    check_weight_shapes(mc, gf.hf_shapes(), gf.path.name, gf.key_names(), gf.gguf_name, stored_order=True)
    # packed on the CPU (the C kernels) and on the GPU path (the Triton kernels): a GGUF's blocks stay blocks
    packed = weights == "auto" and (device == "cpu" or kernels.gpu_path(device))

    def heads_of(name: str) -> int | None:
        return gf.permuted_heads(name, mc.num_heads, mc.num_kv_heads)

    def dense(name: str) -> torch.Tensor:
        w = gf.dequantize(name)
        h = heads_of(name)
        w = np.ascontiguousarray(unpermute_rows(w, h) if h else w)
        return torch.from_numpy(w if w.flags.writeable else w.copy())

    def tensor(name: str, offset: float = 0.0) -> torch.Tensor:
        # llama.cpp's converter stores a Gemma norm as 1 + w already: the file's vector is the multiplier, and
        # the offset is not added again
        return dense(name).reshape(-1).to(device=device, dtype=dtype)

    def part(name: str):
        """(kind, payload) for one stored matrix, in the closest packed form."""
        kind, _ = gf.raw(name)
        k = gf.tensors[gf.gguf_name(name)].shape[0]
        order = gguf_arch.value_head_order(gf, name)      # tiled value heads: rows back in transformers' order
        m = packed_matrix(gf, name, heads_of(name), order[1] if order is not None and order[0] == 0 else None)
        if m is not None and order is not None and order[0] == 1:
            packed_columns.add(name)
        if m is not None:
            grid = {key: (torch.from_numpy(a) if isinstance(a, np.ndarray) else a) for key, a in m.grid.items()}
            return ("mxfp4" if m.kind == "MXFP4" else f"q{m.bits}") + f"/{kind}", (torch.from_numpy(m.codes), grid)
        w = dense(name)
        if kind in ("F16", "BF16"):
            return "16", w.to(torch.bfloat16 if kind == "BF16" else torch.float16)
        if kind == "F32" or k % 32:
            return "32", w
        return "q4f", w            # 2-3 bit and IQ types: re-gridded to 16 levels per group of 32

    def linear(names, bias_names):
        bias = cat_bias([tensor(n) for n in bias_names]) if bias_names else None
        if not packed:
            w = torch.cat([dense(n) for n in names], 0)
            if weights in ("int8", "int4"):
                return quantize_float(w, bias, weights)
            return DenseLinear(w.to(device=device, dtype=dtype), bias)
        parts = []
        for n in names:
            parts.append(part(n))
            gf.release_pages(n)
        groups: list[list] = []
        for kind, payload in parts:          # neighbours of one kind fuse into one matmul
            if groups and groups[-1][0] == kind:
                groups[-1][1].append(payload)
            else:
                groups.append([kind, [payload]])
        made = [_make(kind, payloads).moved(device) for kind, payloads in groups]
        if len(made) == 1:
            made[0].bias = bias
            return made[0]
        return ConcatLinear(made, bias)

    def input_order(name: str):
        """out_proj packed in the file's column order: its input taken so (W_hf y = W_file y[argsort(index)])."""
        if name not in packed_columns:
            return None
        return np.argsort(gguf_arch.value_head_order(gf, name)[1])

    packed_columns: set[str] = set()
    if mc.tie_word_embeddings or not gf.has("lm_head.weight"):
        mc = _tied(mc)
    with _one_thread():
        return _assemble(mc, linear, tensor, dtype, device, "gguf" if packed else weights, gf.quant_summary(),
                         gf.expert_names, input_order, gf.fused_experts)


@contextmanager
def _one_thread():
    """Packing is copies and conversions of small tensors, bound by memory: torch's thread pool only adds a
    barrier to each of them, which costs seconds when the cores are busy with anything else (measured
    here: from_gguf 0.2-0.3 s on one thread against 0.5-5 s on two). Exact either way."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _make(kind: str, payloads: list):
    if kind.startswith(("q4/", "q5/", "q6/", "q8/", "mxfp4/")):
        def join(parts):          # one part stays as it is: no transient copy of a large head
            return parts[0] if len(parts) == 1 else torch.cat(parts, 0)
        codes = join([c for c, _ in payloads])
        grids = [g for _, g in payloads]
        arrays = {key: (join([g[key] for g in grids]) if isinstance(grids[0][key], torch.Tensor) else grids[0][key])
                  for key in grids[0]}
        if kind.startswith("mxfp4/"):         # MXFP4 at its own bits: the E8M0 exponents its only scales
            return MXFP4Linear(codes, arrays["e8m0"])
        if kind.startswith("q6/"):            # Q6_K at its own bits: the high 2 bits beside the scales
            high = arrays.pop("high")
            return Q6Linear(codes, high, Scales(**arrays))
        if kind.startswith("q5/"):            # Q5_0 / Q5_1 / Q5_K at their own bits: the fifth bits beside
            high = arrays.pop("high")
            return Q5Linear(codes, high, Scales(**arrays))
        scales = Scales(**arrays)
        return Q4Linear(codes, scales) if kind.startswith("q4/") else Q8Linear(codes, scales)
    w = torch.cat(payloads, 0)
    if kind == "q4f":
        return Q4Linear.from_float(w)
    return DenseLinear(w)