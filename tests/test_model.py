"""Our forward pass against transformers' own model on the same weights."""
import pytest
import torch

from kvchat.engine import Engine, EngineConfig
from tiny_models import tiny_model_dir

from kvchat.engine.config import CacheConfig as _CacheConfig

FP32_CACHE = _CacheConfig(k_format="fp32", v_format="fp32")   # exact comparisons need the 32-bit cache

CASES = [
    dict(arch="llama", hidden=96, heads=6, kv_heads=6, tie=True),            # GQA ratio 1
    dict(arch="llama", hidden=96, heads=3, kv_heads=1, tie=False),           # ratio 3, odd head count, untied head
    dict(arch="mistral", hidden=80, heads=5, kv_heads=5, tie=False),         # odd heads
    dict(arch="qwen2", hidden=96, heads=6, kv_heads=2, tie=False),           # qkv bias, ratio 3
    dict(arch="qwen2", hidden=72, heads=9, kv_heads=3, tie=True),            # SmolLM-like 9/3 heads
]


def _hf_logits(folder, ids):
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['arch']}-{c['heads']}h{c['kv_heads']}kv")
def test_tiny_logits_match_transformers(tmp_path, case):
    """Logits of a 64-token prompt match transformers within 1e-3 (fp32)."""
    folder = tiny_model_dir(tmp_path, layers=2, **case)
    engine = Engine.load(EngineConfig(model=folder))
    ids = torch.randint(3, engine.model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = engine.new_session(cache=FP32_CACHE).append(ids)
    assert (ours - _hf_logits(folder, ids)).abs().max().item() <= 1e-3


@pytest.mark.slow
def test_default_model_logits_match_transformers(default_engine, hf_default):
    """SmolLM2-135M, dense weights from the GGUF: logits over 64 tokens match transformers' GGUF load within 1e-3."""
    text = "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg " * 4
    ids = default_engine.tokenizer.encode(text, add_special_tokens=False)[:64]
    ours = default_engine.new_session(cache=FP32_CACHE).append(ids)
    with torch.no_grad():
        ref = hf_default(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-3


@pytest.mark.slow
def test_greedy_matches_transformers_generate(default_engine, hf_default):
    """Greedy output equals transformers' greedy decoding for 40 new tokens on 3 prompts (64 tokens took 34 s of the
    suite on a Zen 4). transformers' greedy choices are read in one forward pass over the prompt and our reply: a
    greedy generate() gives a sequence exactly when each of its tokens is the argmax after the ones before it, so
    ours equals generate()'s output exactly when it equals these argmaxes (the first token where they part is the
    first where they differ here), without generate()'s 40 sequential steps."""
    ref = hf_default
    tok = default_engine.tokenizer
    prompts = ["What is the capital of France?", "Explain what a KV cache is.", "How do I reverse a list in Python?"]
    for p in prompts:
        rendered = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        ids = tok.encode(rendered, add_special_tokens=False)
        session = default_engine.new_session(cache=FP32_CACHE)
        logits = session.append(ids)[-1]
        ours = []
        for _ in range(40):
            nxt = int(logits.argmax())
            ours.append(nxt)
            logits = session.append([nxt])[-1]
        with torch.no_grad():
            x = torch.tensor([ids + ours])   # explicit mask: the prompt holds <|im_end|>, which is also the pad token
            out = ref(x, attention_mask=torch.ones_like(x)).logits[0, len(ids) - 1:-1].argmax(-1).tolist()
        assert len(out) == 40 and ours == out, p


@pytest.mark.slow
def test_packed_gguf_weights_track_dense(default_engine):
    """weights=auto keeps the GGUF's blocks packed (Q4_1 codes, Q8_0 head); decode and prefill track dense fp32."""
    from kvchat.engine.text.samples import load_tokens
    fast = Engine.load(EngineConfig(model="default", prefill="fp32"))       # the exact prompt path on every CPU
    assert fast.model.weights == "gguf" and default_engine.model.weights == "dense"
    assert fast.model.linear_kinds() == {"q4": 120, "q8": 1}
    assert fast.model.weight_bytes() < 0.35 * default_engine.model.weight_bytes()
    toks = load_tokens(fast.tokenizer, "prose", 129)
    rows = []
    for engine in (fast, default_engine):
        s = engine.new_session(cache=FP32_CACHE)
        rows.append(torch.cat([s.append([t]) for t in toks[:-1]]))
    agree = (rows[0].argmax(-1) == rows[1].argmax(-1)).float().mean().item()
    assert agree >= 0.98
    # prefill dequantizes slabs of the same codes: the same weights, so the same logits up to fp32 rounding
    prefill = fast.new_session(cache=FP32_CACHE).append(toks[:-1])
    assert (prefill - default_engine.new_session(cache=FP32_CACHE).append(toks[:-1])).abs().max().item() <= 1e-3


def test_safetensors_folder_keeps_stored_dtype(tiny_llama):
    """weights=auto keeps a safetensors folder's stored dtype (fp32 here); int8 / int4 quantize on load."""
    assert Engine.load(EngineConfig(model=tiny_llama)).model.weights == "fp32"
    for kind, expect in (("int8", "q8"), ("int4", "q4")):
        engine = Engine.load(EngineConfig(model=tiny_llama, weights=kind))
        assert set(engine.model.linear_kinds()) == {expect}
