"""Build the Transformer's weights from a source: a GGUF read in place, or a safetensors state dict.

Weight paths (EngineConfig.weights):
- "auto": a GGUF keeps its own blocks packed (4-bit types as int4 groups of 32, 5-8 bit types as
  per-channel int8, 16-bit as 16-bit); a safetensors folder keeps its stored dtype.
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
from kvchat.engine.gguf.file import GGUFFile
from kvchat.engine.errors import ModelLoadError
from kvchat.engine.model.config import ModelConfig
from kvchat.engine.model.transformer import Layer, Transformer
from kvchat.engine.model.config import check_weight_shapes, layer_modules
from kvchat.engine.model.linears import ConcatLinear, DenseLinear, Q4Linear, Q8Linear, cat_bias, quantize_float

def _assemble(mc: ModelConfig, linear, tensor, dtype, device, weights: str, quant: str = "") -> Transformer:
    """linear(names, bias_names) -> a linear (several names: concatenated along the output); tensor(name, offset)
    -> a norm vector holding the multiplier the norm applies, offset + w, where the source stores w (LayerSpec's
    norm_offset: Gemma's (1 + w)). Whether the stored vector is w or already offset + w is the source's to know,
    so each loader's tensor() says which it adds. Module names per family: config.layer_modules."""
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

        layers.append(Layer(
            qkv=lin("qkv", spec.qkv_bias), o=lin("o", spec.o_bias),
            gate_up=lin("gate_up", spec.mlp_bias), down=lin("down", spec.mlp_bias),
            norm_attn=norm("norm_attn"), norm_mlp=norm("norm_mlp"),
            q_norm=norm("q_norm"), k_norm=norm("k_norm"),
            post_attn_norm=norm("post_attn_norm"), post_mlp_norm=norm("post_mlp_norm")))
    table = linear(["model.embed_tokens.weight"], None)
    head = table if mc.tie_word_embeddings else linear(["lm_head.weight"], None)
    # the final norm is the family's kind too (Gemma: 1 + w)
    offset = mc.layers[0].norm_offset if mc.layers else 0.0
    return Transformer(mc, table, layers, tensor("model.norm.weight", offset), head, dtype, device, weights, quant)


# ---- safetensors ---------------------------------------------------------------------------------

def from_state_dict(mc: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device: str,
                    weights: str) -> Transformer:
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

def from_gguf(mc: ModelConfig, gf: GGUFFile, dtype: torch.dtype, device: str, weights: str) -> Transformer:
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
        m = packed_matrix(gf, name, heads_of(name))
        if m is not None:
            grid = {key: (torch.from_numpy(a) if isinstance(a, np.ndarray) else a) for key, a in m.grid.items()}
            return f"q{m.bits}/{kind}", (torch.from_numpy(m.codes), grid)
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

    if mc.tie_word_embeddings or not gf.has("lm_head.weight"):
        mc = _tied(mc)
    with _one_thread():
        return _assemble(mc, linear, tensor, dtype, device, "gguf" if packed else weights, gf.quant_summary())


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
    if kind.startswith(("q4/", "q8/")):
        def join(parts):          # one part stays as it is: no transient copy of a large head
            return parts[0] if len(parts) == 1 else torch.cat(parts, 0)
        codes = join([c for c, _ in payloads])
        grids = [g for _, g in payloads]
        scales = Scales(**{key: (join([g[key] for g in grids]) if isinstance(grids[0][key], torch.Tensor)
                                 else grids[0][key]) for key in grids[0]})
        return Q4Linear(codes, scales) if kind.startswith("q4/") else Q8Linear(codes, scales)
    w = torch.cat(payloads, 0)
    if kind == "q4f":
        return Q4Linear.from_float(w)
    return DenseLinear(w)