"""The whole-step decode kernel (cpu_step.decode_layers: every layer in one C call) gives the same bits as the
layer-by-layer path through Python, for every packed GGUF type (mixed q|k|v types included), one sequence or
more than a kernel call's rows, with and without a window with sinks, full-precision caches (attended inside
the kernel) and quantized ones (attended inside the kernel by the quantized-KV library; the blocks a step
completes quantized after it)."""
import pytest
import torch

from kvchat.engine import Engine, EngineConfig
from kvchat.engine.config import CacheConfig
from kvchat.bench.gguf_writer import write_random_gguf
from kvchat.engine.kv.pages import Component
from kvchat.engine.model.transformer import Transformer
from kvchat.engine.runtime.backends.full_pages import kernel_covers
from kvchat.kernels import cpu_quant, cpu_step

TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q4_K_M", "Q5_1", "Q6_K", "Q8_0")


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    return {t: str(write_random_gguf(folder / f"tiny-{t}.gguf", "tiny", t, seed=5)) for t in TYPES}


def _decode(engine, cache, prompts, steps, fused, paths=None):
    """Prompts prefilled one by one, then `steps` decode steps of all sequences at once: every step's logits.
    paths: a list that gets, per fused step, how it attended ("kernel", "quant" or "callback")."""
    runner = engine.runner
    calls = []
    orig = Transformer.forward_decode

    def spy(self, *a, **k):
        out = orig(self, *a, **k) if fused else None
        calls.append(out is not None)
        if paths is not None:
            kernel = k.get("kernel")
            paths.append("callback" if kernel is None else "quant" if kernel.kind == "quant-pages" else "kernel")
        return out
    Transformer.forward_decode = spy
    try:
        seqs = [runner.new_sequence(cache) for _ in prompts]
        last = [runner.step([(s, p)], hash_ids=False)[0] for s, p in zip(seqs, prompts)]
        out = []
        for _ in range(steps):
            last = runner.step([(s, [int(lg[-1].argmax())]) for s, lg in zip(seqs, last)])
            out.append(torch.cat(last))
        for s in seqs:
            runner.close(s)
    finally:
        Transformer.forward_decode = orig
    assert calls and all(calls) == fused
    return torch.stack(out)


# full-precision pages of both widths and int8 ones: the caches the windowed families' one-call tests run over
WINDOWED_CACHES = (CacheConfig(k_format="bf16", v_format="bf16"),
                   CacheConfig(k_format="fp32", v_format="fp32", block_size=16),
                   CacheConfig(k_format="int8", v_format="int8", block_size=16))


def _one_call_equals_layers(engine, prompts, steps, int8_path, more=None, full_path="kernel"):
    """Over each of WINDOWED_CACHES, the first prompt alone and all of them (int8 pages: all): the one-call step's
    logits are the layer path's bits, and the step attended as full_path says over full-precision pages (inside the
    kernel: "kernel"), as int8_path says over int8 ones. steps: decode steps, or a function of the cache giving them. more(cache, group,
    logits): further checks on the one-call logits."""
    cpu_quant.kv_kernels_ready(wait=True)
    for cache in WINDOWED_CACHES:
        n = steps(cache) if callable(steps) else steps
        for group in ((prompts,) if cache.k_format == "int8" else (prompts[:1], prompts)):
            paths = []
            a = _decode(engine, cache, group, n, fused=True, paths=paths)
            b = _decode(engine, cache, group, n, fused=False)
            assert torch.equal(a, b), (cache, len(group), (a - b).abs().max().item())
            assert set(paths) == ({int8_path} if cache.k_format == "int8" else {full_path}), paths
            if more is not None:
                more(cache, group, a)


@pytest.mark.parametrize("kind", TYPES)
def test_whole_step_kernel_equals_layer_by_layer(ggufs, kind):
    engine = Engine.load(EngineConfig(model=ggufs[kind]))
    assert engine.model.kernel_layers() is not None
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 17, 9)]
    cpu_quant.kv_kernels_ready(wait=True)      # the quantized caches' attention kernel, the same in both runs
    for cache in (CacheConfig(k_format="fp32", v_format="fp32"), CacheConfig(k_format="bf16", v_format="bf16"),
                  CacheConfig(k_format="fp32", v_format="fp32", window=32, sinks=4, block_size=16),
                  CacheConfig(k_format="int8", v_format="int8", block_size=16),
                  CacheConfig(k_format="int4", v_format="fp8", block_size=16, window=32, sinks=4)):
        for group in (prompts[:1], prompts):
            paths = []
            a = _decode(engine, cache, group, 24, fused=True, paths=paths)
            b = _decode(engine, cache, group, 24, fused=False)
            assert torch.equal(a, b), (kind, cache, len(group), (a - b).abs().max().item())
            if cache.k_format in ("int8", "int4"):        # attended in C, blocks completed included
                assert set(paths) == {"quant"}, paths
            else:
                assert set(paths) == {"kernel"}, paths


def test_more_sequences_than_one_kernel_call_takes(ggufs):
    """Eleven sequences: the linears run 8 + 3 rows, as fused() splits them."""
    engine = Engine.load(EngineConfig(model=ggufs["Q4_K_M"]))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 49152, (3 + i,), generator=gen).tolist() for i in range(11)]
    cache = CacheConfig(k_format="fp32", v_format="fp32")
    assert torch.equal(_decode(engine, cache, prompts, 4, fused=True), _decode(engine, cache, prompts, 4, fused=False))


def test_quantized_cache_with_full_precision_layers_calls_back(ggufs):
    """int8 pages with one layer kept full precision: the C quantized attention does not take mixed layers (it
    once tried, and failed the step); the kernel calls back for each layer's attention, the same bits."""
    engine = Engine.load(EngineConfig(model=ggufs["Q4_0"]))
    cpu_quant.kv_kernels_ready(wait=True)
    for fp_layers in ((1,), (0,)):
        cache = CacheConfig(k_format="int8", v_format="int8", block_size=16, full_precision_layers=fp_layers)
        paths = []
        a = _decode(engine, cache, [[5, 6, 7, 8, 9]], 20, fused=True, paths=paths)
        b = _decode(engine, cache, [[5, 6, 7, 8, 9]], 20, fused=False)
        assert torch.equal(a, b) and set(paths) == {"callback"}, (fp_layers, paths)


def test_models_the_kernel_does_not_cover_take_the_layer_path(ggufs, tmp_path):
    """Float weights (F16 here) have no kernel table; a step still decodes, through forward()."""
    path = write_random_gguf(tmp_path / "tiny-F16.gguf", "tiny", "F16", seed=5)
    engine = Engine.load(EngineConfig(model=str(path)))
    assert engine.model.kernel_layers() is None
    s = engine.new_session(cache=CacheConfig(k_format="fp32", v_format="fp32"))
    s.append([5, 6, 7])
    assert s.append([8])[-1].isfinite().all()


def test_mixed_key_and_value_precision_decodes_in_a_batch(ggufs):
    """fp32 keys with bf16 values: no kernel covers the pair, so each layer takes the torch path; batched steps
    still run (a hypothesis run found them failing an assertion) and equal the sequences run alone."""
    engine = Engine.load(EngineConfig(model=ggufs["Q8_0"]))
    cache = CacheConfig(k_format="fp32", v_format="bf16")
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    probe = engine.runner.new_sequence(cache)
    assert not kernel_covers(engine.runner.components(probe), engine.model.config.num_heads)
    engine.runner.close(probe)
    both = _decode(engine, cache, prompts, 3, fused=False)
    alone = [_decode(engine, cache, [p], 3, fused=False) for p in prompts]
    assert both.shape[1] == 2 and torch.isfinite(both).all()
    for i, a in enumerate(alone):
        assert torch.allclose(both[:, i], a[:, 0], atol=1e-4, rtol=1e-4)


def test_an_exception_after_the_kernel_wrote_its_pages_leaves_the_cache_as_before(ggufs):
    """decode_layers writes every layer's new K/V rows (full-precision pages, or a quantized cache's tail rows);
    if the step then fails (here: in the output head), the step is rolled back and the next steps equal those
    of a twin that never saw it. Every step fails once first, the block-completing ones included."""
    engine = Engine.load(EngineConfig(model=ggufs["Q4_0"]))
    runner, head = engine.runner, engine.model.lm_head
    cpu_quant.kv_kernels_ready(wait=True)
    for cache in (CacheConfig(k_format="fp32", v_format="fp32"), CacheConfig(k_format="bf16", v_format="bf16"),
                  CacheConfig(k_format="int8", v_format="int8", block_size=16),
                  CacheConfig(k_format="int4", v_format="fp8", block_size=16, window=32, sinks=4)):
        a, twin = runner.new_sequence(cache), runner.new_sequence(cache)
        for s in (a, twin):
            runner.step([(s, [5, 6, 7, 8, 9])], hash_ids=False)
            runner.step([(s, [10])], all_logits=False)
        calls = []

        def failing(*args, **kw):
            calls.append(1)
            raise RuntimeError("injected after the layers")
        for t in range(11, 11 + 30):
            head.fused = failing
            try:
                with pytest.raises(RuntimeError, match="injected"):
                    runner.step([(a, [t])], all_logits=False)
            finally:
                del head.fused
            assert a.num_tokens == twin.num_tokens
            runner.cache.check()
            (la,), (lt,) = runner.step([(a, [t])], all_logits=False), runner.step([(twin, [t])], all_logits=False)
            assert torch.equal(la, lt), (cache, t)
        assert len(calls) == 30
        runner.close(a), runner.close(twin)


def test_gemma3_layers_run_in_the_one_call_step_with_the_same_bits(tmp_path):
    """Gemma 3's (1 + w) norms, q/k norms, post-norms, GELU-tanh gate and sliding layers: the one-call step gives the
    layer path's bits, one sequence or three, past the window and while the pages grow. Sliding and global layers are
    two KV groups with two RoPE tables, two groups of the call: over full-precision pages each layer attends with its
    group's rows, over int8 pages through its group's QuantStep, as the group's own layer."""
    from kvchat.bench.gguf_writer import ModelShape
    shape = ModelShape("tiny-gemma3", 7, 256, 4, 2, 512, 64, 2048, 1e6, True, arch="gemma3", window=16)
    engine = Engine.load(EngineConfig(model=str(write_random_gguf(tmp_path / "g3.gguf", shape, "Q4_K_M", seed=3))))
    assert engine.model.kernel_layers() is not None
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in (21, 5, 40)]
    _one_call_equals_layers(engine, prompts, lambda cache: 30 if cache.k_format == "fp32" else 12, "quant")


def test_the_one_call_step_follows_the_pages_when_they_move(ggufs):
    """One-call decode steps while the pages grow (a growth moves every layer's pages; the step keeps their addresses
    until then), then prompt rows, which read the pages themselves: the same logits as the layer-by-layer path, which
    looks the pages up at every layer. A step that kept the old addresses would write its keys where no one reads."""
    engine = Engine.load(EngineConfig(model=ggufs["Q4_0"]))
    runner = engine.runner
    cache = CacheConfig(k_format="fp32", v_format="fp32", block_size=16)
    results, moved = [], []
    for fused in (True, False):
        orig = Transformer.forward_decode
        if not fused:
            Transformer.forward_decode = lambda self, *a, **k: None
        try:
            before = Component.moves
            seq = runner.new_sequence(cache)
            last = runner.step([(seq, [5, 77, 901, 33, 8])], hash_ids=False)[0]
            for _ in range(60):
                last = runner.step([(seq, [int(last[-1].argmax())])])[0]
            moved.append(Component.moves - before)
            results.append(runner.step([(seq, [11, 12, 13])], all_logits=True)[0])
            runner.close(seq)
        finally:
            Transformer.forward_decode = orig
    assert moved[0] > 0, "the pages never moved during the one-call steps"
    assert torch.equal(results[0], results[1]), (results[0] - results[1]).abs().max().item()


@pytest.mark.parametrize("qtype", ["Q4_K_M", "MXFP4"])
def test_gpt_oss_layers_run_in_the_one_call_step_with_the_same_bits(tmp_path, qtype):
    """gpt-oss's biases (q | k | v and o: the product, then the bias, then the residual, as fused() adds them), sink
    logits and sliding / full layers (two KV groups): the one-call step gives the layer path's bits, one sequence or
    three, past the window, over full-precision pages (the sinks read inside decode_attend) and int8 ones (the
    QuantStep's)."""
    from kvchat.bench.gguf_writer import ModelShape
    shape = ModelShape("tiny-gpt-oss", 4, 256, 4, 2, 256, 64, 2048, 150000.0, False, arch="gpt-oss", window=16,
                       experts=4, experts_used=2, expert_ffn=256, biases=True, sinks=True, yarn=(32.0, 4096))
    engine = Engine.load(EngineConfig(model=str(write_random_gguf(tmp_path / "oss.gguf", shape, qtype, seed=3))))
    model = engine.model
    assert model.kernel_layers() is not None and any(L.qkv.bias is not None for L in model.layers)
    assert all(s.sink_logits for s in model.config.layers)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in (21, 5, 40)]
    _one_call_equals_layers(engine, prompts, 24, "quant")


def test_gemma2_layers_run_in_the_one_call_step_with_the_same_bits(tmp_path, monkeypatch):
    """Gemma 2's soft-capped scores (cap * tanh(s / cap) inside the C decode attention), post-norms, GELU and sliding
    layers: the one-call step gives the layer path's bits over full-precision pages, one sequence or three, past the
    window, and the torch attention's logits within 2e-3 of the largest (a cap of 2 bends every score); over int8
    pages (whose C attention takes no soft-cap) every layer's attention calls back, the same bits."""
    from kvchat.bench.gguf_hf import write_gguf_from_hf
    from kvchat.engine.runtime.backends.base import AttentionBackend
    from kvchat.engine.runtime.backends.full_pages import FullPagesC, FullPagesTorch
    from tiny_models import tiny_family_dir
    folder = tiny_family_dir(tmp_path / "g2", "gemma2", query_pre_attn_scalar=32,     # what a GGUF can say
                             attn_logit_softcapping=2.0)
    path = write_gguf_from_hf(folder, tmp_path / "g2.gguf", "Q4_K_M")
    engine = Engine.load(EngineConfig(model=str(path)))
    assert engine.model.kernel_layers() is not None
    assert all(s.attn_softcap for s in engine.model.config.layers)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (21, 5, 40)]

    def against_torch(cache, group, a):
        if cache.k_format == "fp32" and len(group) == 3:
            with monkeypatch.context() as m:        # the same steps with FullPagesTorch's attention
                m.setattr(FullPagesC, "attend", FullPagesTorch.attend)
                for name in ("prepare_decodes", "attend_decodes", "one_call_group"):
                    m.setattr(FullPagesC, name, getattr(AttentionBackend, name))
                t = _decode(engine, cache, group, 24, fused=False)
            assert (a - t).abs().max() <= 2e-3 * t.abs().max(), (a - t).abs().max().item()
    _one_call_equals_layers(engine, prompts, 24, "callback", against_torch)


def test_qwen2_biases_run_in_the_one_call_step_with_the_same_bits(tmp_path):
    """Qwen2's biased q, k and v (one packed linear, the bias added after the product as fused() adds it): the
    one-call step gives the layer path's bits."""
    from kvchat.bench.gguf_hf import write_gguf_from_hf
    from tiny_models import tiny_model_dir
    folder = tiny_model_dir(tmp_path / "q2", arch="qwen2", hidden=256, heads=4, kv_heads=2, intermediate=512)
    engine = Engine.load(EngineConfig(model=str(write_gguf_from_hf(folder, tmp_path / "q2.gguf", "Q8_0"))))
    assert engine.model.kernel_layers() is not None and engine.model.layers[0].qkv.bias is not None
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (21, 5)]
    cache = CacheConfig(k_format="fp32", v_format="fp32")
    paths = []
    a = _decode(engine, cache, prompts, 12, fused=True, paths=paths)
    assert torch.equal(a, _decode(engine, cache, prompts, 12, fused=False)) and set(paths) == {"kernel"}


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_qwen35_layers_run_in_the_one_call_step_with_the_same_bits(tmp_path, qtype, monkeypatch):
    """Qwen3.5 (Gated DeltaNet layers and gated attention with a partial rotation): the one-call step runs every
    layer in C, the Gated DeltaNet mixers (gdn_mix, each sequence's state passed in, the new one taken at the
    commit) and the gated attention (the gates set aside from the projection, the q / k norms, the attention over
    the backend's pages, the output times the gates' sigmoid), giving the layer path's bits over full-precision and
    int8 pages, one sequence and three."""
    from kvchat.engine.runtime.backends import StepAttention
    states = []
    orig = StepAttention.kernel_states
    monkeypatch.setattr(StepAttention, "kernel_states",
                        lambda self, layers: states.append(layers) or orig(self, layers))
    from kvchat.bench.gguf_hf import write_gguf_from_hf
    from tiny_models import tiny_family_dir
    shape = dict(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_value_head_dim=16)
    folder = tiny_family_dir(tmp_path / "q35", "qwen3_5", seed=1, **shape)
    engine = Engine.load(EngineConfig(model=str(write_gguf_from_hf(folder, tmp_path / "q35.gguf", qtype))))
    assert engine.model.kernel_layers() is not None and engine.model.config.mixers_called_back
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (5, 17, 9)]
    table, c = engine.model.kernel_layers(), engine.model.config
    assert table[3].gate == c.num_heads * c.head_dim and table[3].q_norm and not table[3].mix_out
    _one_call_equals_layers(engine, prompts, 12, "quant")
    assert states and all(layers == [0, 1, 2] for layers in states)      # the three Gated DeltaNet layers, in C


def test_qwen35_moe_shared_expert_runs_in_the_one_call_step_with_the_same_bits(tmp_path):
    """Qwen3.5-MoE: the routed MLP and the shared expert beside it (SwiGLU, scaled by sigmoid(gate . x)) in C
    (shared_expert_rows, the call the forward makes for decode rows): the layer path's bits, and the torch shared
    expert's numbers within rounding."""
    from kvchat.bench.gguf_hf import write_gguf_from_hf
    from tiny_models import tiny_family_dir
    shape = dict(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_value_head_dim=16,
                 shared_expert_intermediate_size=64)                  # packed: a multiple of 32
    folder = tiny_family_dir(tmp_path / "q35moe", "qwen3_5_moe", seed=1, **shape)
    engine = Engine.load(EngineConfig(model=str(write_gguf_from_hf(folder, tmp_path / "q35moe.gguf", "Q8_0"))))
    model = engine.model
    assert model.kernel_layers() is not None and all(row.shared for row in model.kernel_layers())
    gen = torch.Generator().manual_seed(6)
    L = model.layers[0]
    x, y = (torch.randn(3, model.config.hidden_size, generator=gen) for _ in range(2))
    got = y.clone()
    cpu_quant.shared_expert_(got, x, L.norm_mlp, model.config.rms_norm_eps, model._shared_table(L))
    gu, down, gate = (lin.dequantize().double() for lin in L.shared)         # the float64 reference
    h = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps)
         * L.norm_mlp.double())
    g, u = (h @ gu.T).chunk(2, dim=-1)
    want = y.double() + (torch.nn.functional.silu(g) * u) @ down.T * torch.sigmoid(h @ gate.T)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    assert not torch.allclose(got, y)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (5, 17, 9)]
    _one_call_equals_layers(engine, prompts, 12, "quant")      # every layer in C, the attention over the pages too


@pytest.mark.parametrize("shared", [2, 0])
def test_gemma4_layers_run_in_the_one_call_step_with_the_same_bits(tmp_path, shared):
    """Gemma 4 (heads of each layer's own width, layers reading another layer's KV, normed values, values from keys,
    a proportional rope) with its per-layer inputs and layer scalars in C after each MLP: the layer path's bits over
    full-precision pages, attended inside the kernel (own_attention), and over int8 pages: inside the kernel through
    the quantized-KV library's attend, or called back between the C projections where layers read another's KV (the
    layer path stores a source's row before its readers attend), one sequence and three."""
    from kvchat.bench.gguf_hf import write_gguf_from_hf
    from test_gemma4_gguf import tiny_gemma4_dir
    folder = tiny_gemma4_dir(tmp_path / "gemma4", seed=1, hidden_size_per_layer_input=32,    # packed: 32 wide
                             num_kv_shared_layers=shared)
    engine = Engine.load(EngineConfig(model=str(write_gguf_from_hf(folder, tmp_path / "g4.gguf", "Q8_0"))))
    table = engine.model.kernel_layers()
    assert table is not None and all(row.ple[0].N == 32 and row.scalar for row in table)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 17, 9)]
    _one_call_equals_layers(engine, prompts, 12, "callback" if shared else "quant")


def test_the_kernel_refuses_gemma4_heads_that_do_not_chain(tmp_path):
    """A table's own attention (Gemma 4) is checked before anything runs: a layer reading kept keys no earlier layer
    keeps (or of other widths), a head size its projection does not hold, KV heads that do not divide the query
    heads, a layer both keeping and reading: -3 (ValueError), where the table as built runs."""
    from kvchat.bench.gguf_hf import write_gguf_from_hf
    from test_gemma4_gguf import tiny_gemma4_dir
    folder = tiny_gemma4_dir(tmp_path / "gemma4", seed=1, hidden_size_per_layer_input=0)
    engine = Engine.load(EngineConfig(model=str(write_gguf_from_hf(folder, tmp_path / "g4.gguf", "Q8_0"))))
    table, c = engine.model.kernel_layers(), engine.model.config
    heads = [(row.hd, row.kvh, row.keep, row.from_) for row in table]
    readers = [i for i, h in enumerate(heads) if h[3]]
    assert all(h[0] for h in heads) and readers and any(h[2] for h in heads)
    x = torch.zeros(1, c.hidden_size)

    def attend(layer, qkv):
        return torch.zeros(1, table[layer].mix_out)

    def run(t):
        cpu_step.decode_layers(t, x, c.rms_norm_eps, c.num_heads, c.num_kv_heads, c.head_dim, [attend])
    run(table)
    r = readers[0]
    keeper = next(i for i, h in enumerate(heads) if h[2] == heads[r][3])
    edits = [(r, "from_", heads[r][3] + 5), (keeper, "keep", 0), (r, "hd", heads[r][0] + 2),
             (0, "kvh", c.num_heads + 1), (r, "keep", heads[r][3])]
    for layer, field, value in edits:
        bad = type(table).from_buffer_copy(table)
        setattr(bad[layer], field, value)
        with pytest.raises(ValueError, match="width does not match"):
            run(bad)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_gemma4_experts_beside_the_dense_mlp_run_in_the_one_call_step(tmp_path, qtype):
    """Gemma 4's mixture of experts (26B-A4B): GELU experts beside the dense MLP, the router reading its own norm
    (router.scale), each chosen weight times its expert's scale, the dense and the routed outputs each normed, their
    sum normed and added: in C (moe_layer_rows with the router's norm, beside_rows), the call the forward makes for
    decode rows, so the one-call step gives the layer path's bits; and the C experts against float64."""
    from kvchat.bench.gguf_hf import write_gguf_from_hf
    from test_gemma4_gguf import MOE, tiny_gemma4_dir
    folder = tiny_gemma4_dir(tmp_path / "g4moe", seed=2, hidden_size_per_layer_input=0, **MOE)     # as 26B-A4B
    engine = Engine.load(EngineConfig(model=str(write_gguf_from_hf(folder, tmp_path / "g4moe.gguf", qtype))))
    model = engine.model
    table = model.kernel_layers()
    assert table is not None and all(row.moe and row.beside[0] and row.nparts[2] for row in table)
    L, eps = model.layers[0], model.config.rms_norm_eps
    mlp = L.mlp
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, model.config.hidden_size, generator=gen) * 3
    got = cpu_quant.moe_layer(x, L.beside[1], eps, mlp.kernel_table(), None).double()
    xd = x.double()
    unit = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    logits = (unit * mlp.router_scale.double()) @ mlp.router.dequantize().double().T
    w, ids = logits.softmax(-1).topk(mlp.spec.used, dim=-1)
    w = w / w.sum(-1, keepdim=True) * mlp.expert_scale.double()[ids]
    xn = unit * L.beside[1].double()
    want = torch.zeros_like(xd)
    for r in range(x.shape[0]):
        for j in range(mlp.spec.used):
            e = int(ids[r, j])
            g, u = (xn[r] @ lin.dequantize().double().T for lin in (mlp.gate[e], mlp.up[e]))
            act = torch.nn.functional.gelu(g, approximate="tanh") * u
            want[r] += w[r, j] * (act @ mlp.down[e].dequantize().double().T)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3 * float(want.abs().max()))
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 17, 9)]
    _one_call_equals_layers(engine, prompts, 12, "callback")
    # the Experts page's counts: a decode token through the one-call step counts `used` experts a layer, once each
    s = engine.new_session(cache=CacheConfig(k_format="bf16", v_format="bf16"))
    s.append(prompts[1])
    for L in model.layers:
        L.mlp.count(True)
    try:
        s.append(prompts[0][:1])
        for L in model.layers:
            hits = L.mlp.counts()
            assert int(hits.sum()) == int((hits > 0).sum()) == mlp.spec.used and hits.max() == 1
    finally:
        for L in model.layers:
            L.mlp.count(False)
        s.close()
