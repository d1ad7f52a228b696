"""kvchat.engine.model.families is the one registry of architectures, its description is what a GGUF and a Hugging Face
folder of one model both read as, and the one-shot sampler chooses as the engine's does."""
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from kvchat.bench.gguf_hf import write_gguf_from_hf
from kvchat.bench.gguf_writer import permute
from kvchat.engine.config import SamplingParams
from kvchat.engine.errors import ModelLoadError
from kvchat.engine.model.gguf_view import GGUFModel
from kvchat.engine.model import families
from kvchat.engine.model.config import ModelConfig
from kvchat.engine.model.source import load_state_dict, read_config
from kvchat.engine.model.spec import LayerSpec, Rope
from kvchat.engine.model.weights import from_gguf, from_state_dict
from kvchat.engine.runtime.sampling import sample, sample_numpy
from tiny_models import tiny_model_dir

def test_unsupported_architecture_names_the_registry(tmp_path):
    """A config.json and a GGUF of an architecture outside the registry are refused with one message that lists
    exactly the registry's families, in its order."""
    listed = "(" + ", ".join(f.name for f in families.FAMILIES) + ")"
    with pytest.raises(ModelLoadError) as info:
        ModelConfig.from_hf(dict(model_type="falcon", vocab_size=320, hidden_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=128))
    assert str(info.value) == f"unsupported architecture 'falcon' in config.json: kvchat runs the Llama family {listed}"
    with pytest.raises(ModelLoadError) as info:
        families.gguf_family("rwkv6", "x.gguf")
    assert str(info.value).endswith(listed)
    for f in families.FAMILIES:
        # a GGUF arch reads as the first family that names it (Mixtral's files are arch llama: the llama family,
        # which reads their expert count)
        first = next(g for g in families.FAMILIES if g.gguf_arch == f.gguf_arch)
        assert families.family(f.model_types[0], "here") is f and families.gguf_family(f.gguf_arch, "here") is first
    assert families.gguf_family("llama", "here").name == "llama"


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_gguf_and_folder_read_as_one_description(tmp_path, arch):
    """The same tiny model as a Hugging Face folder and as a GGUF gives one ModelConfig (shape and every layer's
    spec), and the same weights once the registry's rule for llama.cpp's q / k row order is applied."""
    folder = tiny_model_dir(tmp_path / arch, arch=arch, tie=False, seed=4)
    gf = GGUFModel(write_gguf_from_hf(folder, tmp_path / f"{arch}.gguf", "F32"))
    # llama.cpp's converter interleaves q / k rows for llama only: read raw, apart from the registry's flag
    q = load_state_dict(Path(folder))["model.layers.0.self_attn.q_proj.weight"].numpy()
    stored = np.asarray(gf.tensors["blk.0.attn_q.weight"].data)
    assert np.array_equal(stored, permute(q, 4) if arch == "llama" else q)
    from_file, from_folder = ModelConfig.from_gguf(gf), ModelConfig.from_hf(read_config(Path(folder)))
    assert from_file.rms_norm_eps == pytest.approx(from_folder.rms_norm_eps, rel=1e-6)     # float32 in a GGUF
    assert from_file == replace(from_folder, rms_norm_eps=from_file.rms_norm_eps)
    assert from_file.layers == (from_file.layers[0],) * from_file.num_layers
    assert from_file.layers[0].qkv_bias == (arch == "qwen2") and not from_file.layers[0].o_bias
    assert from_file.fused_kernel_ok            # Qwen2's biases too: lin_apply adds them
    a = from_gguf(from_file, gf, torch.float32, "cpu", "dense")
    b = from_state_dict(from_folder, load_state_dict(Path(folder)), torch.float32, "cpu", "dense")
    for la, lb in zip(a.layers, b.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            x, y = getattr(la, name), getattr(lb, name)
            assert torch.equal(x.dequantize(), y.dequantize()), (arch, name)
            assert (x.bias is None) == (y.bias is None) and (x.bias is None or torch.equal(x.bias, y.bias))


def test_layer_spec_says_what_the_fused_step_covers():
    """The C step's rule is the description's: each way a layer leaves the Llama layer takes it out."""
    base = LayerSpec(rope=Rope(10000.0), query_scale=0.125)
    assert base.fused_kernel_ok and replace(base, qk_norm=True).fused_kernel_ok    # Qwen3's: qk_norm_rows
    gemma3 = replace(base, qk_norm=True, norm_offset=1.0, post_norms=True, activation="gelu_tanh", window=512)
    assert gemma3.fused_kernel_ok       # norm_add_rows, gelu_gate_rows; the window is the attention's
    # Qwen3.5's gated attention with a partial rotation: in C (the order the weights' own, the gate set aside)
    qwen35 = replace(base, rope=Rope(10000.0, dims=32), attn_gate=True, qk_norm=True)
    assert qwen35.fused_kernel_ok and qwen35.order_in_weights and not qwen35.mixer_called_back
    # Gemma 4's own head widths, shared KV, normed values and proportional rope: their mixers called back, the rest
    # in C; a routed MLP beside a dense one stays out
    for change in (dict(head_dim=64), dict(value_norm=True), dict(kv_source=0),
                   dict(rope=Rope(1e6, ("proportional", 0.25)))):
        layer = replace(base, **change)
        assert layer.fused_kernel_ok and layer.mixer_called_back, change
    assert not base.mixer_called_back and not gemma3.mixer_called_back
    # Gemma 2's capped scores (the C attention caps them), biases (lin_apply adds them), gpt-oss's sink logits
    for change in (dict(attn_softcap=50.0), dict(qkv_bias=True), dict(o_bias=True), dict(mlp_bias=True),
                   dict(sink_logits=True)):
        assert replace(base, **change).fused_kernel_ok, change
    # a partial rotation over plain q / k rows (Phi-3): the loader takes the rows in its order, the C step runs it
    assert replace(base, rope=Rope(10000.0, dims=32)).fused_kernel_ok
    with pytest.raises(ValueError):
        LayerSpec(rope=Rope(1e4), query_scale=0.125, activation="relu")


def test_rope_scaling_replaced_in_the_layers_that_used_it():
    """A GGUF's rope_freqs replace the model's rope in its layers (with_rope_scaling); a layer with a rope of its
    own keeps it, and the frequencies are the layer's."""
    mc = ModelConfig.from_hf(dict(model_type="llama", vocab_size=320, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=128))
    local = Rope(500.0)
    mc = replace(mc, layers=(replace(mc.layers[0], rope=local), mc.layers[1]))
    factors = tuple(float(i + 1) for i in range(mc.head_dim // 2))
    scaled = mc.with_rope_scaling(("factors", factors))
    assert scaled.layers[0].rope == local and scaled.layers[1].rope == Rope(10000.0, ("factors", factors))
    assert np.array_equal(scaled.rope_frequencies(1), scaled.rope_frequencies())
    assert np.array_equal(scaled.rope_frequencies(0), local.frequencies(mc.head_dim))
    assert not scaled.fused_kernel_ok             # two ropes: the one-call step takes one table
    with pytest.raises(ValueError, match="qkv_bias"):
        replace(mc, qkv_bias=True)                # a flat field that disagrees with the layers


def test_numpy_and_torch_samplers_choose_alike():
    """Where no random draw decides (greedy with a repetition penalty, top-k 1, a top-p that keeps one token),
    sample_numpy picks what sample picks."""
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    for _ in range(30):
        logits = torch.randn(300, generator=g) * 3
        recent = [int(i) for i in torch.randint(0, 300, (12,), generator=g)]
        for params in (SamplingParams(temperature=0.0, repetition_penalty=1.3),
                       SamplingParams(temperature=0.0),
                       SamplingParams(temperature=0.8, top_k=1, repetition_penalty=1.2),
                       SamplingParams(temperature=0.8, top_p=1e-6, repetition_penalty=0.8)):
            assert sample_numpy(logits.numpy(), params, recent, rng) == sample(logits, params, recent, None), params


def test_the_forward_reads_the_description(tiny_engine):
    """The torch forward computes what the description says at the model level (embedding scale, final soft-cap);
    a layer the one-call C step does not compute (a soft-capped one) keeps the model on the layer-by-layer path; a
    model built over another's layers with a partial rotation leaves those layers as they were."""
    from kvchat.engine.model.transformer import Transformer
    m = tiny_engine.model
    c = m.config

    def model(config):
        return Transformer(config, m.table, m.layers, m.norm, m.lm_head, m.dtype, m.device, m.weights)

    def zero_attention(layer, q, k, v):          # no cache: each layer's attention output is zero
        return torch.zeros_like(q)

    ids = torch.tensor([1, 2, 3])
    plain = model(c).forward(ids, zero_attention, all_logits=True)
    capped = model(replace(c, final_softcap=2.0)).forward(ids, zero_attention, all_logits=True)
    assert torch.allclose(capped, 2.0 * torch.tanh(plain / 2.0), atol=1e-6) and capped.abs().max() < 2.0
    scaled = model(replace(c, embed_scale=3.0)).forward(ids, zero_attention, all_logits=True)
    assert not torch.allclose(scaled, plain)
    capped_c = model(replace(c, final_softcap=2.0)).config     # the forward caps around the C step; the one-shot
    assert capped_c.fused_kernel_ok and not capped_c.one_table_ok      # path's own table does not
    layers = (replace(c.layers[0], attn_softcap=50.0),) + c.layers[1:]
    capped_scores = model(replace(c, layers=layers)).config     # the C attention caps them; the one-shot path not
    assert capped_scores.fused_kernel_ok and not capped_scores.one_table_ok
    qkv = m.layers[0].qkv
    layers = (replace(c.layers[0], rope=Rope(c.rope_theta, dims=c.head_dim // 2)),) + c.layers[1:]
    turned = model(replace(c, layers=layers))
    assert turned.layers[0].qkv is not qkv and m.layers[0].qkv is qkv     # its own copy's rows, in the new order


def test_the_numpy_rope_twin_gives_the_torch_rope_values():
    """The one-shot path's RoPE rows (numpy, no torch) are the engine's, bit for bit, far into a long stream."""
    from kvchat.engine.model.rope import rope_cos_sin
    from kvchat.engine.model.spec import rope_cos_sin_numpy
    inv_freq = Rope(500000.0, ("llama3", 32.0, 1.0, 4.0, 8192)).frequencies(64)
    positions = np.array([0, 1, 2, 17, 1000, 8191, 8192, 65_535, 131_071])
    cos_np, sin_np = rope_cos_sin_numpy(positions, inv_freq)
    cos_t, sin_t = rope_cos_sin(torch.from_numpy(positions), torch.from_numpy(inv_freq))
    assert np.array_equal(cos_np, cos_t.numpy()) and np.array_equal(sin_np, sin_t.numpy())
