"""Mixtures of experts through the engine (issue 38 item 5): tiny Qwen3-MoE (8 experts, 3 used, a dense layer among
the routed ones) and gpt-oss (4 experts, 2 used, sink logits, sliding / full layers over a window of 16) folders
from transformers' own classes, their experts packed to int4 on load where the test is about packed weights.

Against transformers on the same folder: every cache format and the user's window + sinks. Then what the cache's
owners do on an MoE model, exactly as on a dense one: a batched step equals solo steps bit for bit (packed
experts: a decode row goes through the kernel whatever its expert's group), speculation equals plain decoding,
a saved cache restores to the same next logits bit for bit, and the server's batched requests answer as alone.
A decode token reads only its routed experts."""
from __future__ import annotations

import math
import threading
from pathlib import Path

import httpx
import pytest
import torch

from kvchat.engine import CacheConfig, Engine, EngineConfig, SamplingParams, SpeculativeConfig
from kvchat.engine.errors import ModelLoadError
from kvchat.engine.events import TurnFinished
from kvchat.engine.model.config import ModelConfig
from kvchat.engine.model.source import locate, read_config, transformers_reference
from kvchat.engine.runtime import speculative
from kvchat.engine.runtime.warm import WarmStore
from kvchat.engine.serve.server import ServeConfig, Server
from misguided import Misguided
from tiny_models import read_chunks, tiny_family_dir

FP32 = CacheConfig(k_format="fp32", v_format="fp32")
IDS = torch.randint(3, 320, (120,), generator=torch.Generator().manual_seed(4)).tolist()
OFF = SpeculativeConfig("off")
LOOKUP = SpeculativeConfig("lookup", k=6, ngram_max=3, ngram_min=1, adaptive=False)
REPLY = SamplingParams(temperature=0.0, max_new_tokens=48)


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def moe(request, tmp_path_factory):
    """(family, its folder, transformers' model on it)."""
    folder = tiny_family_dir(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, folder, transformers_reference(locate(folder), torch.float32).eval()


@pytest.fixture(scope="module")
def dense(moe):
    return Engine.load(EngineConfig(model=moe[1], weights="dense"))


@pytest.fixture(scope="module")
def packed(moe):
    """The same folder with every linear (experts and router included) packed to int4 groups of 32."""
    engine = Engine.load(EngineConfig(model=moe[1], weights="int4"))
    engine.set_speculative(OFF)
    return engine


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    return float((got - want).abs().max()) <= tol * float(want.abs().max())


def reference_logits(reference, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([ids])).logits[0].float()


def read(engine, seq, ids, sizes=(30, 1, 1, 20, 1)):
    """tiny_models.read_chunks: prompt chunks and one-token steps."""
    return read_chunks(engine, seq, ids, sizes)


CACHES = {"fp32": FP32, "bf16": CacheConfig(), "int8": CacheConfig(k_format="int8", v_format="int8"),
          "fp8": CacheConfig(k_format="fp8", v_format="fp8"), "int4": CacheConfig(k_format="int4", v_format="int4")}


@pytest.mark.parametrize("cache", list(CACHES))
def test_every_cache_format_reads_as_transformers(moe, dense, cache):
    """fp32: within 1e-3 of transformers' largest logit. The rounding of the other formats can send a token to
    another expert (a jump, not a drift: a bound on the logits says little), so they are held to transformers'
    top token at most positions: 90% for bf16 and int8, 80% for fp8 and int4 (a random tiny model's flat
    logits make the top token fragile; measured 90-100%)."""
    s = dense.new_session(cache=CACHES[cache])
    got = read(dense, s.seq, IDS)
    want = reference_logits(moe[2], IDS)
    assert torch.isfinite(got).all()
    if cache == "fp32":
        assert close(got, want, 1e-3)
    else:
        floor = 0.9 if cache in ("bf16", "int8") else 0.8
        assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= floor
    dense.runner.cache.check()
    s.close()


def test_the_users_window_and_sinks_run_on_moe(dense):
    """window + sinks on top of gpt-oss's own sliding layers (and on Qwen3-MoE's full ones): the window slides,
    every layer holds at most the user's window, the logits stay finite."""
    s = dense.new_session(cache=FP32.with_(window=32, sinks=4, block_size=8))
    got = read(dense, s.seq, IDS)
    assert torch.isfinite(got).all()
    assert max(m.evicted for m in s.seq.members) > 0
    assert all(m.seq_len <= 32 + 8 for m in s.seq.members)
    dense.runner.cache.check()
    s.close()


def test_greedy_tokens_equal_transformers(moe, dense):
    s = dense.new_session(cache=FP32)
    logits = s.append(IDS[:30], all_logits=False)
    ours = []
    for _ in range(24):          # past the window of 16 on gpt-oss's sliding layers
        ours.append(int(logits[-1].argmax()))
        logits = s.append(ours[-1:], all_logits=False)
    with torch.no_grad():
        theirs = moe[2].generate(torch.tensor([IDS[:30]]), max_new_tokens=24, do_sample=False)[0, 30:].tolist()
    assert ours == theirs
    s.close()


def test_a_batched_step_equals_solo_steps_bit_for_bit(packed):
    """A decode of one conversation and a prompt chunk of another in one step: each row's numbers as alone, the
    decode row's experts read by the kernel though its expert's group also holds prompt rows."""
    runner = packed.runner
    solo, pair = [], []
    for out in (solo, pair):
        a, b = packed.new_session(cache=FP32), packed.new_session(cache=FP32)
        runner.step([(a.seq, IDS[:40])], hash_ids=False)
        if out is solo:
            out.append(runner.step([(a.seq, IDS[40:41])], hash_ids=False)[0])
            out.append(runner.step([(b.seq, IDS[50:90])], hash_ids=False)[0])
        else:
            out.extend(runner.step([(a.seq, IDS[40:41]), (b.seq, IDS[50:90])], hash_ids=False,
                                   decode=[True, False]))
        a.close()
        b.close()
    for x, y in zip(solo, pair):
        assert torch.equal(x, y)


def test_a_decode_token_reads_only_its_routed_experts(packed):
    """One decode token: each routed layer counts exactly `used` distinct experts, once each (the C kernels read
    the router and those experts' slabs, nothing else); a prompt counts `used` per token too."""
    model = packed.runner.model
    routed = [L.mlp for L in model.layers if L.mlp is not None]
    s = packed.new_session(cache=FP32)
    s.append(IDS[:20])
    for mlp in routed:
        mlp.count(True)
    try:
        s.append(IDS[20:21])
        for mlp in routed:
            hits = mlp.counts()
            assert int(hits.sum()) == mlp.spec.used and int((hits > 0).sum()) == mlp.spec.used and hits.max() == 1
        s.append(IDS[21:41])
        for mlp in routed:
            assert int(mlp.counts().sum()) == 21 * mlp.spec.used
    finally:
        for mlp in routed:
            mlp.count(False)
        s.close()


def test_the_one_call_step_covers_packed_experts(moe, packed):
    """Qwen3-MoE's and gpt-oss's packed experts run in decode_layers (one C call for the whole step; gpt-oss's
    biases, sink logits and two KV groups too), the same bits as the forward's per-layer path."""
    model = packed.runner.model
    table = model.kernel_layers()
    assert table is not None
    a, b = packed.new_session(cache=FP32), packed.new_session(cache=FP32)
    a.append(IDS[:30])
    b.append(IDS[:30])
    got = a.append(IDS[30:31])                     # the whole step in decode_layers
    model._kernel_layers, model._kernel_checked = None, True
    try:
        want = b.append(IDS[30:31])               # the forward, layer by layer (moe_layer_rows for the experts)
    finally:
        model._kernel_checked = False
    assert torch.equal(got, want)
    a.close()
    b.close()


@pytest.mark.parametrize("router", ["packed", "float32"])
def test_decode_rows_in_the_kernel_equal_the_grouped_path(packed, router):
    """moe_layer_rows against the linears one expert at a time (the path of prompt rows and of kinds the kernels
    do not read): the same experts, the same sums to float rounding; with the router packed, or in float32 rows
    as a GGUF keeps ffn_gate_inp."""
    from kvchat.engine.model.experts import RoutedMLP
    from kvchat.engine.model.linears import DenseLinear
    model = packed.runner.model
    layer = next(L for L in model.layers if L.mlp is not None)
    mlp = layer.mlp
    if router == "float32":
        mlp = RoutedMLP(mlp.spec, DenseLinear(mlp.router.dequantize()), mlp.router_bias, mlp.gate, mlp.up, mlp.down,
                        mlp.gate_bias, mlp.up_bias, mlp.down_bias)
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    fast = mlp.fused(x, layer.norm_mlp, 1e-5, x, split=3)
    table = mlp.kernel_table()
    mlp._table = None                      # the grouped path, checked already: kept off for this call
    try:
        slow = mlp.fused(x, layer.norm_mlp, 1e-5, x, split=3)
    finally:
        mlp._table = table
    assert table is not None and close(fast, slow, 1e-5)


def test_speculation_gives_plain_decodings_tokens(packed, monkeypatch):
    monkeypatch.setattr(speculative, "PromptLookup", Misguided)
    tokens = {}
    for spec in (OFF, LOOKUP):
        packed.set_speculative(spec)
        s = packed.new_session(cache=FP32, prefix_cache=False)
        finished = [e for e in s.send("The fox jumps. " * 6, REPLY) if isinstance(e, TurnFinished)]
        tokens[spec.method] = s.token_ids
        if spec is LOOKUP:
            st = finished[-1].stats.spec
            assert st.drafted > 0
        s.close()
    packed.set_speculative(OFF)
    assert tokens["lookup"] == tokens["off"]


def test_a_saved_cache_restores_to_the_same_logits(packed, tmp_path):
    packed._warm_store = WarmStore(tmp_path / "kv")
    try:
        for cache in (FP32, CacheConfig(k_format="int8", v_format="int8")):
            s = packed.new_session(cache=cache)
            packed.keep_warm(s, "m")
            s.append(IDS[:70])
            assert packed.save_warm(s) > 0
            s2 = packed.new_session(cache=cache)
            packed.keep_warm(s2, "m")
            packed.restore_warm(s2)
            assert s2.seq.num_tokens == s.seq.num_tokens
            assert torch.equal(s.append([7, 8, 9]), s2.append([7, 8, 9]))
            packed.runner.cache.check()
            s.close()
            s2.close()
    finally:
        packed._warm_store = None


def test_the_server_answers_batched_requests_as_alone(packed):
    server = Server(packed, ServeConfig(port=0, model_id="tiny", max_num_seqs=4, prefill_chunk=32),
                    FP32.with_(budget_mb=16))
    server.start()
    try:
        bodies = [{"model": "tiny", "prompt": IDS[i:i + 20], "temperature": 0, "max_tokens": 24} for i in (0, 30, 60)]
        alone = [httpx.post(server.base_url + "/completions", json=b, timeout=120).json()["choices"][0]["text"]
                 for b in bodies]
        together: list = [None] * len(bodies)

        def ask(i):
            together[i] = httpx.post(server.base_url + "/completions", json=bodies[i], timeout=120).json()
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r["choices"][0]["text"] for r in together] == alone
    finally:
        server.stop()


@pytest.mark.parametrize("field, value, named", [
    ("num_experts_per_tok", 9, "num_experts_per_tok=9 but the model has only 8 experts"),
    ("num_experts", 0, "num_experts=0"),
    ("moe_intermediate_size", "64", "moe_intermediate_size='64'")])
def test_impossible_expert_settings_are_one_line(tmp_path, field, value, named):
    cfg = read_config(Path(tiny_family_dir(tmp_path / "q", "qwen3_moe")))
    cfg.pop("num_local_experts", None)
    cfg["num_experts"] = 8
    cfg[field] = value
    with pytest.raises(ModelLoadError, match=named) as info:
        ModelConfig.from_hf(cfg)
    assert "\n" not in str(info.value)


def test_descriptions_of_the_moe_families(tmp_path):
    q = ModelConfig.from_hf(read_config(Path(tiny_family_dir(tmp_path / "q", "qwen3_moe"))))
    assert [s.experts is None for s in q.layers] == [False, True, False]          # mlp_only_layers=[1]
    ex = q.layers[0].experts
    assert (ex.count, ex.used, ex.ffn, ex.normalize, ex.activation) == (8, 3, 64, False, "silu")
    g = ModelConfig.from_hf(read_config(Path(tiny_family_dir(tmp_path / "g", "gpt_oss"))))
    assert [s.window for s in g.layers] == [16, None, 16, None]
    assert all(s.sink_logits and s.qkv_bias and s.o_bias and s.experts.router_bias and s.experts.expert_bias
               and s.experts.activation == "swiglu_oai" for s in g.layers)
    kind, factor, fast, slow, original, truncate = g.layers[0].rope.scaling
    assert (kind, factor, original, truncate) == ("yarn", 32.0, 4096, False)
    attention_factor = 0.1 * math.log(32) + 1
    assert g.layers[0].query_scale == pytest.approx(32 ** -0.5 * attention_factor ** 2)
    sm = ModelConfig.from_hf(read_config(Path(tiny_family_dir(tmp_path / "s", "smollm3"))))
    assert [s.rope.scaling for s in sm.layers] == [(), (), (), ("nope",)]
    assert not sm.fused_kernel_ok


def test_the_stats_say_which_experts_the_last_turn_used(packed):
    """StatsSnapshot.experts: per routed layer, the last turn's tokens per expert (prompt and reply; each token
    `used` times), None for the dense layer; a new turn counts from 0."""
    s = packed.new_session(cache=FP32)
    events = list(s.send("Tell me about foxes.", SamplingParams(temperature=0.0, max_new_tokens=8)))
    stats = events[-1].stats
    spec = packed.runner.config.layers
    assert len(stats.experts) == len(spec)
    totals = set()
    for layer, counts in zip(spec, stats.experts):
        if layer.experts is None:
            assert counts is None
            continue
        assert len(counts) == layer.experts.count and sum(counts) % layer.experts.used == 0
        totals.add(sum(counts) // layer.experts.used)
    (tokens,) = totals                              # every routed layer saw the same tokens
    assert stats.prefill_tokens + 7 <= tokens <= stats.prefill_tokens + 8
    second = list(s.send("And owls?", SamplingParams(temperature=0.0, max_new_tokens=4)))[-1].stats
    counted = sum(next(c for c in second.experts if c is not None)) // next(l.experts for l in spec if l.experts).used
    assert second.prefill_tokens + 3 <= counted <= second.prefill_tokens + 4 < tokens
    s.close()


def test_gpt_oss_mxfp4_experts_run_in_the_kernels(tmp_path):
    """A gpt-oss GGUF in ggml-org's MXFP4 mix: its experts stay MXFP4 (4.25 bits a weight) and the decode rows'
    routed MLP runs in moe_layer_rows over them, equal to the linears one expert at a time."""
    from kvchat.bench.gguf_hf import write_gguf_from_hf
    from kvchat.engine.model.linears import MXFP4Linear
    path = write_gguf_from_hf(tiny_family_dir(tmp_path / "g", "gpt_oss"), tmp_path / "g.gguf", "MXFP4")
    engine = Engine.load(EngineConfig(model=str(path)))
    layer = next(L for L in engine.runner.model.layers if L.mlp is not None)
    mlp = layer.mlp
    assert isinstance(mlp.gate[0], MXFP4Linear) and mlp.kernel_table() is not None
    x = torch.randn(3, engine.runner.config.hidden_size, generator=torch.Generator().manual_seed(6))
    fast = mlp.fused(x, layer.norm_mlp, 1e-5, x, split=3)
    table, mlp._table = mlp._table, None
    try:
        slow = mlp.fused(x, layer.norm_mlp, 1e-5, x, split=3)
    finally:
        mlp._table = table
    assert close(fast, slow, 1e-5)
    s = engine.new_session(cache=FP32)
    assert torch.isfinite(s.append(IDS[:40])).all()
    s.close()


def test_prompt_rows_of_small_expert_groups_go_in_one_call(packed):
    """The grouped prompt path's one C call (moe_grouped_rows) gives what the loop over experts gives (the same
    kernels per group; only the activation's rounding differs), and it is the path prompt rows take."""
    from kvchat.engine.model import experts as ex
    mlp = next(L.mlp for L in packed.model.layers if L.mlp is not None)
    torch.manual_seed(0)
    xn = torch.randn(40, packed.model.config.hidden_size)
    weights, chosen = mlp.route(xn, 0)
    table = mlp.kernel_table()
    assert table is not None
    one_call = mlp._grouped(xn, weights, chosen, 0, None)
    original = ex.RoutedMLP.kernel_table
    ex.RoutedMLP.kernel_table = lambda self: None
    try:
        loop = mlp._grouped(xn, weights, chosen, 0, None)
    finally:
        ex.RoutedMLP.kernel_table = original
    assert float((one_call - loop).abs().max()) <= 1e-5 * float(loop.abs().max())
    assert not torch.equal(one_call, torch.zeros_like(one_call))
