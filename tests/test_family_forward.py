"""The families of issue 23 (Qwen3, Gemma 2, Gemma 3, Phi-3) through our dense forward, against transformers' own
model on the same Hugging Face folder (tests/tiny_models.py: tiny_family_dir), on a prompt three times the
sliding window; and the one-line errors of what kvchat does not run.

The forward is driven by a reference attention written plainly from each layer's description (exact_attention),
so that those tests check the forward and the description alone; test_the_engine_matches_transformers then runs
the same models through the engine's own cache and attention."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvchat.engine.errors import ModelLoadError
from kvchat.engine.model.config import ModelConfig
from kvchat.engine.model.families import family
from kvchat.engine.model.rope import rope_cos_sin, rotate
from kvchat.engine.model.source import load_state_dict, locate, read_config, transformers_reference
from kvchat.engine.model.spec import LayerSpec
from kvchat.engine.model.transformer import Transformer
from kvchat.engine.model.weights import from_state_dict
from tiny_models import tiny_family_dir

PROMPT = 48            # three times the tiny models' window of 16


def load_dense(folder: str) -> Transformer:
    """Our Transformer on a Hugging Face folder, read as the engine reads one (weights="dense", fp32)."""
    mc = ModelConfig.from_hf(read_config(Path(folder)))
    return from_state_dict(mc, load_state_dict(Path(folder)), torch.float32, "cpu", "dense")


def exact_attention(config: ModelConfig, sinks: list | None = None):
    """Attention over a whole prompt at positions 0..T-1 from each layer's spec: q and k rotated by the layer's
    rope (its first rope.dims dimensions), scores times query_scale, soft-capped, causal, and within the window
    (the query at p sees keys p - window < k <= p); sinks[i]: layer i's learned sink logits [Hq] (gpt-oss), one
    more column of the softmax that is dropped before the values."""
    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [T, Hq, D], k and v [T, Hkv, D] -> [T, Hq, D]
        spec: LayerSpec = config.layers[i]
        T, Hq, D = q.shape
        positions = torch.arange(T)
        d = spec.rope.dims or D
        cos, sin = rope_cos_sin(positions, torch.from_numpy(spec.rope.frequencies(D)))
        q = torch.cat((rotate(q[..., :d].contiguous(), cos, sin), q[..., d:]), -1)
        k = torch.cat((rotate(k[..., :d].contiguous(), cos, sin), k[..., d:]), -1)
        group = Hq // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * spec.query_scale
        if spec.attn_softcap is not None:
            scores = spec.attn_softcap * torch.tanh(scores / spec.attn_softcap)
        qpos, kpos = positions[:, None], positions[None, :]
        allowed = kpos <= qpos
        if spec.window is not None:
            allowed &= kpos > qpos - spec.window
        scores = scores.masked_fill(~allowed, -math.inf)
        if sinks is not None and sinks[i] is not None:
            column = sinks[i].float()[:, None, None].expand(Hq, T, 1)
            probs = torch.cat((scores, column), -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        return torch.einsum("hqk,khd->qhd", probs, v)
    return attend


def reference_logits(folder: str, ids: torch.Tensor) -> torch.Tensor:
    ref = transformers_reference(locate(folder), torch.float32).eval()
    with torch.no_grad():
        return ref(ids[None]).logits[0].float()


CASES = {"qwen3": {}, "gemma2": {}, "gemma3": {}, "phi3": {}, "phi3-longrope": dict(longrope=True),
         "phi3-window": dict(sliding_window=16), "qwen3_moe": {}, "qwen3_moe-normalized": dict(norm_topk_prob=True),
         "mixtral": {}, "gpt_oss": {}, "smollm3": {}}


@pytest.mark.parametrize("case", list(CASES))
def test_dense_forward_matches_transformers(tmp_path, case):
    """All logits of a 48-token prompt within 1e-3 of the largest, every feature of the family on (window 16)."""
    folder = tiny_family_dir(tmp_path / case, case.split("-")[0], **CASES[case])
    ids = torch.randint(3, 320, (PROMPT,), generator=torch.Generator().manual_seed(1))
    model = load_dense(folder)
    ours = model.forward(ids, exact_attention(model.config, [L.sinks for L in model.layers]), all_logits=True)
    theirs = reference_logits(folder, ids)
    err = (ours - theirs).abs().max().item()
    assert err <= 1e-3 * theirs.abs().max().item(), (case, err)
    # the one-call C step computes Phi-3's layer without a window (LongRoPE's short factors are a rope table, its
    # attention factor one query scale for every layer), Qwen3's (the Llama layer plus qk_norm_rows) and Gemma 3's
    # (post-norms and GELU in C, its sliding and global layers' attention called back), Gemma 2's (its soft-capped
    # scores in the C attention) and gpt-oss's (biases in lin_apply, sink logits in the attention); the one-shot path
    # neither windows nor caps nor biases nor sinks
    assert model.config.fused_kernel_ok == (case in ("phi3", "phi3-longrope", "qwen3", "qwen3_moe", "qwen3_moe-normalized",
                                                     "mixtral", "gemma3", "gemma2", "gpt_oss"))
    assert model.config.one_table_ok == (model.config.fused_kernel_ok and case not in ("gemma3", "gemma2", "gpt_oss"))


@pytest.mark.parametrize("case", list(CASES))
def test_the_engine_matches_transformers(tmp_path, case):
    """The same prompt through the engine itself (its paged fp32 cache and its own attention: windows, caps, scales,
    a rope per layer), weights="dense": within 1e-3 of the largest logit of transformers' model."""
    from kvchat.engine import Engine, EngineConfig
    from kvchat.engine.config import CacheConfig
    folder = tiny_family_dir(tmp_path / case, case.split("-")[0], **CASES[case])
    ids = torch.randint(3, 320, (PROMPT,), generator=torch.Generator().manual_seed(1))
    fp32 = CacheConfig(k_format="fp32", v_format="fp32")
    if case == "phi3-longrope":     # a cache of 64 tokens (512 B each), the original context: the short factors,
        fp32 = fp32.with_(budget_mb=64 * 512 / 2**20)    # transformers' for 48 (past it: test_r3_text_longrope.py)
    engine = Engine.load(EngineConfig(model=folder, weights="dense", cache=fp32))
    ours = engine.new_session().append(ids.tolist(), all_logits=True)
    theirs = reference_logits(folder, ids)
    assert (ours - theirs).abs().max() <= 1e-3 * theirs.abs().max()


@pytest.mark.parametrize("fam", ["qwen3", "gemma2", "gemma3", "phi3", "qwen3_moe", "mixtral", "gpt_oss", "smollm3"])
def test_greedy_generation_gives_transformers_tokens(tmp_path, fam):
    """32 greedy tokens after a 24-token prompt (so the reply runs past the window of 16 into position 56): the same
    tokens as transformers' generate, each step our forward over the whole sequence."""
    folder = tiny_family_dir(tmp_path / fam, fam, seed=3)
    prompt = torch.randint(3, 320, (24,), generator=torch.Generator().manual_seed(2))
    ref = transformers_reference(locate(folder), torch.float32).eval()
    with torch.no_grad():
        theirs = ref.generate(prompt[None], max_new_tokens=32, do_sample=False, min_new_tokens=32,
                              pad_token_id=0)[0, len(prompt):].tolist()
    model = load_dense(folder)
    ids = prompt.tolist()
    for _ in range(32):
        attention = exact_attention(model.config, [L.sinks for L in model.layers])
        ids.append(int(model.forward(torch.tensor(ids), attention).argmax()))
    assert ids[len(prompt):] == theirs


def test_each_feature_moves_the_logits(tmp_path):
    """The comparison can fail: the reference attention without the window, or a Gemma norm read as w instead of
    1 + w, lands far outside the bound."""
    folder = tiny_family_dir(tmp_path / "g3", "gemma3")
    ids = torch.randint(3, 320, (PROMPT,), generator=torch.Generator().manual_seed(1))
    theirs = reference_logits(folder, ids)
    bound = 1e-3 * theirs.abs().max().item()
    model = load_dense(folder)
    unwindowed = replace(model.config, layers=tuple(replace(s, window=None) for s in model.config.layers))
    assert (model.forward(ids, exact_attention(unwindowed), all_logits=True) - theirs).abs().max() > 100 * bound
    model.norm = model.norm - 1.0                  # the final norm as the stored w
    assert (model.forward(ids, exact_attention(model.config), all_logits=True) - theirs).abs().max() > 100 * bound


def test_descriptions_read_the_config_fields(tmp_path):
    """What each family's describe() makes of its config: the fields the forward and the runtime read."""
    g3 = ModelConfig.from_hf(read_config(Path(tiny_family_dir(tmp_path / "g3", "gemma3"))))
    assert [s.window for s in g3.layers] == [16] * 5 + [None]
    assert {s.rope.theta for s in g3.layers[:5]} == {10000.0} and g3.layers[5].rope.scaling[:2] == ("linear", 8.0)
    assert (g3.rope_theta, g3.embed_scale, g3.final_softcap) == (1e6, 8.0, None)
    assert all(s.qk_norm and s.post_norms and s.norm_offset == 1.0 and s.activation == "gelu_tanh"
               and s.query_scale == 24 ** -0.5 and s.attn_softcap is None for s in g3.layers)
    g2 = ModelConfig.from_hf(read_config(Path(tiny_family_dir(tmp_path / "g2", "gemma2"))))
    assert [s.window for s in g2.layers] == [16, None, 16, None] and g2.final_softcap == 30.0
    assert all(s.attn_softcap == 50.0 and not s.qk_norm for s in g2.layers)
    q3 = ModelConfig.from_hf(read_config(Path(tiny_family_dir(tmp_path / "q3", "qwen3"))))
    assert q3.head_dim == 32 and all(s.qk_norm and not s.post_norms and s.window is None for s in q3.layers)
    phi = ModelConfig.from_hf(read_config(Path(tiny_family_dir(tmp_path / "p", "phi3", longrope=True))))
    cfg = read_config(tmp_path / "p")
    assert phi.layers[0].rope.scaling == ("factors", tuple(cfg["rope_parameters"]["short_factor"]))
    attention_factor = math.sqrt(1 + math.log(256 / 64) / math.log(64))
    assert phi.layers[0].query_scale == pytest.approx(16 ** -0.5 * attention_factor ** 2)
    # the older spelling of Gemma 3's ropes and pattern reads the same
    old = dict(read_config(tmp_path / "g3"), rope_theta=1e6, rope_local_base_freq=10000.0, sliding_window_pattern=6,
               rope_scaling={"rope_type": "linear", "factor": 8.0})
    del old["rope_parameters"], old["layer_types"]
    assert ModelConfig.from_hf(old).layers == g3.layers


def test_a_partial_rotation_runs_as_transformers_does(tmp_path):
    """Phi-4-mini's partial rotary factor (rope.dims: the first 8 of 16 dimensions turn), through the engine's
    paged cache, equals transformers' logits; the engine turns whole heads in another order (Rope.permutation)."""
    from kvchat.engine import CacheConfig, Engine, EngineConfig
    from kvchat.engine.model.source import locate, transformers_reference
    folder = Path(tiny_family_dir(tmp_path / "p", "phi3", partial_rotary_factor=0.5))
    assert ModelConfig.from_hf(read_config(folder)).layers[0].rope.dims == 8
    ids = list(range(5, 60))
    with torch.no_grad():
        want = transformers_reference(locate(str(folder)), torch.float32).eval()(torch.tensor([ids])).logits[0]
    engine = Engine.load(EngineConfig(model=str(folder), weights="dense"))
    s = engine.new_session(cache=CacheConfig(k_format="fp32", v_format="fp32"))
    got = torch.cat([engine.runner.step([(s.seq, ids[:40])], all_logits=True)[0]] +
                    [engine.runner.step([(s.seq, [t])], all_logits=True)[0] for t in ids[40:]])
    assert float((got - want).abs().max()) <= 1e-3 * float(want.abs().max())


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3", "dbrx"])
def test_moe_architectures_not_run_yet_are_named_as_such(arch):
    with pytest.raises(ModelLoadError) as info:
        family(arch, "config.json")
    text = str(info.value)
    assert repr(arch) in text and "mixture-of-experts families other than mixtral, qwen3_moe and gpt_oss" in text
    assert text.endswith("llama, mistral, qwen2, qwen3, gemma2, gemma3, gemma4, phi3, mixtral, qwen3_moe, gpt_oss, smollm3, "
                         "qwen3_5, qwen3_5_moe")


def test_the_multimodal_gemma3_folder_is_refused_by_name():
    with pytest.raises(ModelLoadError, match="gemma3_text"):
        family("gemma3", "config.json")


def test_a_gemma_folder_missing_a_post_norm_names_it(tmp_path):
    """A gemma folder without post_feedforward_layernorm names that tensor (Gemma's four norms are expected)."""
    from safetensors.torch import load_file, save_file
    folder = Path(tiny_family_dir(tmp_path / "g2", "gemma2"))
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.post_feedforward_layernorm.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"lacks the tensor model\.layers\.1\.post_feedforward_layernorm\.weight"):
        load_dense(str(folder))
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "gemma2"


def test_a_partial_rotation_runs_in_the_one_call_step(tmp_path):
    """A Phi-4-mini-shaped GGUF (bench/gguf_writer.py's phi3: fused q|k|v and gate|up, 48 of 64 dimensions turn):
    its q and k rows are taken in the rotation's order at load (no step gathers them), so the one-call C step covers
    it, and its decode logits equal the layer-by-layer path's bit for bit, fp32 and int8 caches."""
    from kvchat.bench.gguf_writer import ModelShape, write_random_gguf
    from kvchat.engine import CacheConfig, Engine, EngineConfig
    shape = ModelShape("tiny-phi", 2, 256, 4, 2, 512, 64, 2048, 10000.0, True, arch="phi3", rotary=48)
    path = write_random_gguf(tmp_path / "phi.gguf", shape, "Q4_K_M", seed=1)
    engine = Engine.load(EngineConfig(model=str(path)))
    model = engine.model
    assert model.config.layers[0].rope.dims == 48 and model._order == [None, None]
    assert model.config.fused_kernel_ok and model.kernel_layers() is not None
    ids = list(range(10, 30))
    for cache in (CacheConfig(k_format="fp32", v_format="fp32"), CacheConfig(k_format="int8", v_format="int8")):
        a, b = engine.new_session(cache=cache), engine.new_session(cache=cache)
        a.append(ids)
        b.append(ids)
        got = torch.cat([a.append([7]), a.append([9])])
        model._kernel_layers, model._kernel_checked = None, True
        try:
            want = torch.cat([b.append([7]), b.append([9])])
        finally:
            model._kernel_checked = False
        assert torch.equal(got, want), cache.label()
