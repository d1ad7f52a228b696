"""Layers that keep a recurrent state instead of a KV cache (issue 40): Qwen3.5's Gated DeltaNet beside gated full
attention with a partial rotation, and Qwen3.5-MoE's routed MLP with a shared expert, from transformers' own classes
(tests/tiny_models.py: 6 value heads over 2 key heads, which do not divide the 4 attention heads; a conv of 4 taps;
head_dim 32 rotated over its first 8 dimensions).

The state is the KV cache's other citizen (engine/kv/state.py): its bytes are in the budget and in the per-layer
numbers, a failed step leaves it as it was, and its snapshots let regenerate, rewind and a saved cache go back
without reading the chat again. Each check here fails when the thing it names is broken: a state not carried
through a fork reads garbage, a snapshot at the wrong place changes the greedy reply, a state left out of a saved
file is refused."""
from __future__ import annotations

import pytest
import torch

from kvchat.engine import CacheConfig, Engine, EngineConfig, SamplingParams
from kvchat.engine.config import ConfigError
from kvchat.engine.kv.saved import CacheFileError
from kvchat.engine.model import linear_attention as gdn
from kvchat.engine.model.source import locate, transformers_reference
from kvchat.engine.model.spec import Rope
from kvchat.engine.runtime.warm import WarmStore
from tiny_models import read_chunks, tiny_family_dir

FP32 = CacheConfig(k_format="fp32", v_format="fp32")
IDS = torch.randint(3, 320, (150,), generator=torch.Generator().manual_seed(4)).tolist()
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)
CHAT = ["Hello! How are you today? The quick brown fox.", "Paris is the capital of France.",
        "def add(a, b):\n    return a + b\n"]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def family(request, tmp_path_factory):
    folder = tiny_family_dir(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, folder, transformers_reference(locate(folder), torch.float32).eval()


@pytest.fixture(scope="module")
def engine(family):
    return Engine.load(EngineConfig(model=family[1], weights="dense"))


def read(engine, seq, ids, sizes=(70, 1, 1, 20, 1)):
    """tiny_models.read_chunks: prompt chunks over a state, and one-token steps."""
    return read_chunks(engine, seq, ids, sizes)


def test_logits_equal_transformers_through_chunks_and_steps(family, engine):
    """fp32 within 1e-3 of transformers' largest logit over prompt chunks (a chunk of 70 spans two of the delta
    rule's 64-token chunks) and single decode steps; the state after them is what the next token reads."""
    with torch.no_grad():
        want = family[2](torch.tensor([IDS])).logits[0].float()
    s = engine.new_session(cache=FP32)
    got = read(engine, s.seq, IDS)
    assert float((got - want).abs().max()) <= 1e-3 * float(want.abs().max())
    assert s.seq.state.position == len(IDS)
    engine.runner.cache.check()
    s.close()


def test_cache_modes_apply_to_the_attention_layers_only(family, engine):
    """int8 pages and a window + sinks change the attention layers' KV; the linear layers' state is the same bytes
    and still float32 (stats say "state"), and the top token mostly agrees with transformers."""
    with torch.no_grad():
        want = family[2](torch.tensor([IDS])).logits[0].float()
    for cache in (CacheConfig(k_format="int8", v_format="int8"), FP32.with_(window=48, sinks=4, block_size=8)):
        s = engine.new_session(cache=cache)
        got = read(engine, s.seq, IDS)
        assert torch.isfinite(got).all()
        if cache.window is None:
            assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.9
        st = s.stats()
        linear = [layer for layer in st.layers if layer.kind == "linear_attention"]
        assert [layer.layer for layer in linear] == [0, 2]
        assert all(layer.k_bytes == layer.v_bytes == 0 and layer.k_format == "state" for layer in linear)
        assert sum(layer.state_bytes for layer in linear) == st.state_bytes == engine.runner.state_layout.bytes
        s.close()


def test_the_chunked_rule_is_the_one_token_rule():
    """linear_attention.chunked over 150 tokens from a random state equals step() token by token (1e-4), and
    transformers' own chunked reference on the same inputs."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    g = torch.Generator().manual_seed(0)
    T, Hk, Hv, Dk, Dv = 150, 2, 6, 16, 8
    q, k = torch.randn(T, Hk, Dk, generator=g), torch.randn(T, Hk, Dk, generator=g)
    v = torch.randn(T, Hv, Dv, generator=g)
    decay = -torch.rand(T, Hv, generator=g)
    beta = torch.rand(T, Hv, generator=g)
    state = torch.randn(Hv, Dk, Dv, generator=g) * 0.1
    qp, kp = gdn.prepare(q, k, Hv)
    slow, s1 = gdn.step(qp, kp, v, decay, beta, state)
    fast, s2 = gdn.chunked(qp, kp, v, decay, beta, state)
    assert float((slow - fast).abs().max()) < 1e-4 and float((s1 - s2).abs().max()) < 1e-4
    ref, s3 = torch_chunk_gated_delta_rule(q[None], k[None], v[None], decay[None], beta[None], initial_state=state[None],
                                           output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert float((ref[0] - fast).abs().max()) < 1e-4 and float((s3[0] - s2).abs().max()) < 1e-4
    # the C kernel's one pass per token (what the engine runs on the CPU), the same for a prompt cut anywhere
    from kvchat.kernels import cpu_quant
    if cpu_quant.available():
        whole, s4 = gdn.rule(q, k, v, decay, beta, state, decode=False)
        first, mid = gdn.rule(q[:37], k[:37], v[:37], decay[:37], beta[:37], state, decode=False)
        rest, s5 = gdn.rule(q[37:], k[37:], v[37:], decay[37:], beta[37:], mid, decode=True)
        assert torch.equal(torch.cat((first, rest)), whole) and torch.equal(s4, s5)
        assert float((whole - slow).abs().max()) < 1e-4 and float((s4 - s1).abs().max()) < 1e-4
        assert not torch.equal(state, s4)           # the state handed in is not written


def test_a_partial_rotation_is_a_whole_head_one_in_another_order():
    """Rope.permutation + Rope.table: the rotate-half of the first 8 of 32 dimensions (transformers' partial RoPE)
    equals the whole-head rotate-half of the permuted head with the passed-through pairs at frequency 0."""
    from kvchat.engine.model.rope import rope_cos_sin, rotate
    rope = Rope(10000.0, (), 8)
    x = torch.randn(5, 3, 32)
    pos = torch.arange(100, 105)
    cos, sin = rope_cos_sin(pos, torch.from_numpy(rope.frequencies(32)))
    part = x[..., :8]
    turned = torch.cat((part * cos[:, None] + torch.cat((-part[..., 4:], part[..., :4]), -1) * sin[:, None],
                        x[..., 8:]), -1)
    order = torch.from_numpy(rope.permutation(32))
    cos32, sin32 = rope_cos_sin(pos, torch.from_numpy(rope.table(32)))
    assert torch.allclose(rotate(x[..., order], cos32, sin32), turned[..., order], atol=1e-6)


def chat(engine, turns=CHAT, cache=FP32):
    s = engine.new_session(cache=cache)
    replies = [s.reply(text, GREEDY) for text in turns]
    return s, replies


def test_regenerate_and_rewind_read_no_prompt_again(engine):
    """Regenerate forks from the snapshot where the reply began: it reads only the new reply's tokens and gives the
    same greedy reply; rewind to a message and resend gives the uninterrupted reply, reading only that message."""
    s, replies = chat(engine)
    events = list(s.regenerate(GREEDY))
    assert events[-1].text == replies[-1]
    assert events[-1].stats.prefill_tokens == 0 and s.turn_times.state_reread == 0
    s.rewind(2)
    before, held = engine.runner.tokens_read, s.seq.num_tokens
    assert s.reply(CHAT[1], GREEDY) == replies[1]
    assert engine.runner.tokens_read - before < 2 * (s.seq.num_tokens - held)    # this message and reply only
    assert s.stats().snapshots and s.stats().state_bytes > 0
    engine.runner.cache.check()
    s.close()


def test_snapshots_count_against_the_budget(engine):
    s, _ = chat(engine, CHAT[:2])
    state = s.seq.state
    assert len(state.snapshots) >= 2
    held = engine.runner.cache.conversation_bytes(s.seq)
    kv = sum(k + v for k, v in engine.runner.layer_bytes(s.seq))
    kept = 1 + len(state.snapshots) + (state.journal is not None)    # live, snapshots, a verification's copy
    assert held >= kv + state.bytes == kv + state.layout.bytes * kept
    s.reset()
    assert not state.snapshots and state.position == 0
    s.close()


def test_take_back_without_a_snapshot_returns_to_one_and_reads_the_gap(engine):
    """A take-back to where no snapshot is: the cache refuses it exactly, and the session returns to the latest
    snapshot before and reads the few tokens between (counted); the next logits equal an uninterrupted read."""
    s = engine.new_session(cache=FP32)
    s.append(IDS[:60])
    engine.runner.snapshot(s.seq)
    s.append(IDS[60:80])
    with pytest.raises(ConfigError, match="snapshot"):
        engine.runner.truncate(s.seq, 5)
    assert s._take_back(5)
    assert s.seq.num_tokens == 75 and s.turn_times.state_reread == 15
    del s.token_ids[75:]
    t = engine.new_session(cache=FP32)
    t.append(IDS[:75])
    assert torch.allclose(s.append([5]), t.append([5]), atol=1e-5)
    s.close()
    t.close()


def test_a_failed_step_leaves_the_state_as_it_was(engine):
    s = engine.new_session(cache=FP32)
    s.append(IDS[:40])
    before = (s.seq.state.conv.clone(), s.seq.state.matrices.clone())
    with pytest.raises(ConfigError):
        s.append([10 ** 9])                 # refused before any step
    model = engine.runner.model
    broken = model.layers[-1].o
    model.layers[-1].o = None               # the last layer fails after the state layers ran
    try:
        with pytest.raises(Exception):
            engine.runner.step([(s.seq, IDS[40:50])])
    finally:
        model.layers[-1].o = broken
    assert torch.equal(s.seq.state.conv, before[0]) and torch.equal(s.seq.state.matrices, before[1])
    assert s.seq.state.position == s.seq.num_tokens == 40
    s.close()


def test_a_saved_cache_keeps_the_state_and_its_snapshots(engine, tmp_path):
    engine._warm_store = WarmStore(tmp_path / "kv")
    try:
        s, replies = chat(engine, CHAT[:2])
        engine.keep_warm(s, "m")
        assert engine.save_warm(s) > 0
        s2 = engine.new_session(cache=FP32, history=list(s.messages))
        engine.keep_warm(s2, "m")
        engine.restore_warm(s2)
        assert s2.seq.num_tokens == s.seq.num_tokens
        assert sorted(s2.seq.state.snapshots) == sorted(s.seq.state.snapshots)
        events = list(s2.regenerate(GREEDY))        # from the restored snapshot: no prompt read
        assert events[-1].text == replies[-1]
        assert events[-1].stats.prefill_tokens == 0 and s2.turn_times.state_reread == 0
        # a file whose state was damaged is refused whole (the chat is read again)
        groups, tensors = engine.runner.export_kv(s.seq)
        tensors["state.matrices"] = tensors["state.matrices"] * float("nan")
        s3 = engine.new_session(cache=FP32)
        with pytest.raises(CacheFileError, match="not finite"):
            engine.runner.import_kv(s3.seq, groups, tensors)
        del tensors["state.matrices"]
        with pytest.raises(CacheFileError, match="recurrent state"):
            engine.runner.import_kv(s3.seq, groups, tensors)
        assert s3.seq.num_tokens == 0
        engine.runner.cache.check()
        for x in (s, s2, s3):
            x.close()
    finally:
        engine._warm_store = None


def test_a_spare_state_takes_a_steps_new_state_without_a_copy(family, engine):
    """Where the budget has room, a step writes its new state into a spare (kv/state.py), which then becomes the live
    state: the same logits as steps that copy the state, the spare's bytes in the conversation's; with no room for
    one, no spare and the same logits; a reset gives it back."""
    cache = engine.runner.cache
    before = cache.spare_bytes
    s = engine.new_session(cache=FP32)
    got = read(engine, s.seq, IDS)
    state = s.seq.state
    assert engine.runner.model.states_in_c() and state.spare is not None
    assert cache.spare_bytes == before + state.layout.bytes                 # the pool's, apart from the state's
    live, spare = state.matrices.data_ptr(), state.spare[1].data_ptr()
    engine.runner.step([(s.seq, IDS[:1])])
    assert (state.matrices.data_ptr(), state.spare[1].data_ptr()) == (spare, live)    # taken, not copied
    kv = cache.conversation_bytes(s.seq) - state.bytes
    s.reset()
    assert state.spare is None and cache.spare_bytes == before
    s.close()
    # a budget that holds the KV and the live state, and a spare only while the KV is small: the spare goes when
    # the blocks need its room, and every step after copies
    tight = Engine.load(EngineConfig(model=family[1], weights="dense"))
    s = tight.new_session(cache=FP32.with_(budget_mb=(kv + 1.5 * state.layout.bytes) / 2 ** 20))
    assert torch.equal(read(tight, s.seq, IDS), got) and s.seq.state.spare is None
    s.close()


def test_a_budget_too_small_for_the_state_says_so(family):
    """The state is held from the conversation's first token: a budget that cannot hold it and one block is a
    clear error, not a crash at the first step."""
    engine = Engine.load(EngineConfig(model=family[1], weights="dense"))
    state = engine.runner.state_layout.bytes
    block = engine.runner.layout(FP32).block_bytes
    with pytest.raises(ConfigError, match="recurrent state"):
        engine.new_session(cache=FP32.with_(budget_mb=(state + block // 2) / 2 ** 20))
    s = engine.new_session(cache=FP32.with_(budget_mb=(state + 2 * block) / 2 ** 20))
    s.append(IDS[:10])
    s.close()


def test_the_published_multimodal_folder_reads_as_its_language_model(family, engine, tmp_path):
    """Qwen3.5's checkpoints are multimodal: config.json holds the text model under text_config and the weights
    live under model.language_model. beside a vision tower. kvchat reads the language model and its logits are the
    text model's."""
    import json
    import shutil
    from pathlib import Path
    from safetensors.torch import load_file, save_file
    name, folder, _ = family
    out = tmp_path / "mm"
    shutil.copytree(folder, out)
    text = json.loads((Path(folder) / "config.json").read_text())
    outer = name                                        # qwen3_5 / qwen3_5_moe: the multimodal model_type
    (out / "config.json").write_text(json.dumps({"model_type": outer, "text_config": text,
                                                 "vision_config": {"depth": 2}, "tie_word_embeddings": True}))
    state = load_file(str(Path(folder) / "model.safetensors"))
    moved = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): t for n, t in state.items()}
    moved["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    (out / "model.safetensors").unlink()
    save_file(moved, str(out / "model.safetensors"))
    mm = Engine.load(EngineConfig(model=str(out), weights="dense"))
    a, b = mm.new_session(cache=FP32), engine.new_session(cache=FP32)
    assert torch.equal(a.append(IDS[:40]), b.append(IDS[:40]))
    a.close()
    b.close()


def test_the_server_answers_batched_requests_as_alone(engine):
    """Requests batched in one step each read their own state: the answers equal those of each request alone."""
    import httpx
    from kvchat.engine.serve.server import ServeConfig, Server
    server = Server(engine, ServeConfig(port=0, model_id="tiny", max_num_seqs=4, prefill_chunk=32), FP32.with_(budget_mb=16))
    server.start()
    try:
        bodies = [{"model": "tiny", "prompt": IDS[i:i + 20], "temperature": 0, "max_tokens": 16} for i in (0, 30, 60)]
        post = lambda b: httpx.post(server.base_url + "/completions", json=b, timeout=120).json()["choices"][0]["text"]  # noqa: E731
        alone = [post(b) for b in bodies]
        import concurrent.futures
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            together = list(pool.map(post, bodies))
        assert together == alone
    finally:
        server.stop()


def test_the_planner_counts_every_parameter(family):
    """plan.fit.parameter_counts of the description equals transformers' parameter count (the DeltaNet's
    projections, conv taps, dt and A, the gated attention's doubled q_proj, the shared expert and its gate)."""
    from kvchat.engine.plan.fit import parameter_counts
    from kvchat.engine.model.config import ModelConfig
    from kvchat.engine.model.source import read_config
    from pathlib import Path
    mc = ModelConfig.from_hf(read_config(Path(family[1])))
    assert parameter_counts(mc)[0] == sum(p.numel() for p in family[2].parameters())


def test_speculative_decoding_over_a_state_gives_plain_decodings_tokens(engine, monkeypatch):
    """Drafts verified in one step over the state; rejected ones go back by replaying the accepted rows from the
    state before the step (kv/state.StepJournal), so greedy tokens equal plain decoding's and the state after the
    turn equals a plain run's. The proposer knows plain decoding's tokens and spoils the last of each proposal, so
    every verification accepts some rows and rejects others."""
    from kvchat.engine import SpeculativeConfig
    from kvchat.engine.runtime import speculative
    text = "the cache the cache the cache holds keys and values"
    params = SamplingParams(temperature=0.0, max_new_tokens=30)
    engine.set_speculative(SpeculativeConfig("off"))
    s = engine.new_session(cache=FP32)
    list(s.send(text, params))
    plain, plain_state = list(s.token_ids), (s.seq.state.matrices.clone(), s.seq.state.position)
    s.close()

    class Oracle(speculative.PromptLookup):
        def propose(self, ids, most):
            ahead = plain[len(ids):len(ids) + most]
            return ahead[:-1] + [(ahead[-1] + 1) % 300 + 3] if len(ahead) > 1 else []

    monkeypatch.setattr(speculative, "PromptLookup", Oracle)
    engine.set_speculative(SpeculativeConfig("lookup", k=4, ngram_max=3, ngram_min=1, adaptive=False))
    try:
        s = engine.new_session(cache=FP32)
        events = list(s.send(text, params))
        st = events[-1].stats.spec
        assert st is not None and st.drafted > st.accepted > 0       # drafts both accepted and rejected
        assert s.token_ids == plain
        assert s.seq.state.position == plain_state[1]
        assert torch.allclose(s.seq.state.matrices, plain_state[0], atol=1e-5)
        s.close()
    finally:
        engine.set_speculative(SpeculativeConfig("off"))


def test_a_verification_step_goes_back_to_any_of_its_rows(engine):
    """Truncating inside the last multi-row decode step replays its rows from the state before it: replaying all of
    them gives the step's own state bit for bit, so the state after a take-back is the one the step had after the
    kept rows; it is that of a run fed only those rows within rounding (a 6-row step's projections round apart
    from 1-row steps')."""
    import copy
    rows = IDS[60:66]
    a, b = engine.new_session(cache=FP32), engine.new_session(cache=FP32)
    a.append(IDS[:60])
    b.append(IDS[:60])
    engine.runner.step([(a.seq, rows)], decode=[True])          # a verification: six generated rows at once
    state = a.seq.state
    after = (state.conv.clone(), state.matrices.clone())
    journal = copy.copy(state.journal)
    state._replay(journal, 6)
    assert torch.equal(state.conv, after[0]) and torch.equal(state.matrices, after[1])
    state.journal = journal
    engine.runner.truncate(a.seq, 4)
    for t in rows[:2]:
        engine.runner.step([(b.seq, [t])])
    assert a.seq.num_tokens == b.seq.num_tokens == 62 == state.position
    scale = float(b.seq.state.matrices.abs().max())
    assert float((state.matrices - b.seq.state.matrices).abs().max()) <= 1e-4 * scale
    with pytest.raises(ConfigError, match="snapshot"):        # once gone back, not further than the step's start
        engine.runner.truncate(a.seq, 5)
    a.close()
    b.close()


SYSTEM = ("You are a careful assistant. Answer briefly and precisely, and say so when you do not know. " * 3).strip()


def test_conversations_sharing_a_prefix_share_the_state_after_it(engine):
    """Prefix sharing over a state: a second conversation with the same system prompt adopts the cached blocks up to
    the block boundary before its own message and the state kept there (KVCache.publish_state), reads only the rest,
    and replies as one that read everything; a resent history (an API client's next request) starts from the state
    the first conversation's reply left at its last block boundary."""
    engine.clear_prefix_cache()
    a = engine.new_session(cache=FP32, system_prompt=SYSTEM)
    first = a.reply(CHAT[0], GREEDY)
    assert engine.runner.cache.points.points          # kept where the message began and where the reply stands
    before = engine.runner.tokens_read
    b = engine.new_session(cache=FP32, system_prompt=SYSTEM)
    second = b.reply(CHAT[1], GREEDY)
    reused = b.stats().prefix_reused_tokens
    assert reused >= 16 and reused % 16 == 0
    assert engine.runner.tokens_read - before == b.seq.num_tokens - reused      # the rest, and the reply
    fresh = engine.new_session(cache=FP32, system_prompt=SYSTEM, prefix_cache=False)
    assert fresh.reply(CHAT[1], GREEDY) == second
    # the same history sent again with the next message: read from the reply's last block boundary on
    held = a.seq.num_tokens
    c = engine.new_session(cache=FP32, system_prompt=SYSTEM, history=list(a.messages))
    alone = engine.new_session(cache=FP32, system_prompt=SYSTEM, history=list(a.messages), prefix_cache=False)
    assert c.reply(CHAT[2], GREEDY) == alone.reply(CHAT[2], GREEDY)
    # (the reply's last block may be written otherwise when sent back: the point a block before it serves then)
    assert c.stats().prefix_reused_tokens >= held // 16 * 16 - 16, (c.stats().prefix_reused_tokens, held)
    engine.runner.cache.check()
    for x in (a, b, c, fresh, alone):
        x.close()


def test_state_points_count_and_give_way(engine):
    """Each kept point is a whole state in the budget; clearing the prefix cache returns them, and room takes them
    before it releases any conversation."""
    engine.clear_prefix_cache()
    cache = engine.runner.cache
    held = cache._blocks.held_bytes
    a = engine.new_session(cache=FP32, system_prompt=SYSTEM)
    a.reply(CHAT[0], GREEDY)
    points = len(cache.points.points)
    spares = cache.spare_bytes                  # a's state's spare (kv/state.py), room beside the points
    assert points and cache._blocks.extra_bytes == points * engine.runner.state_layout.bytes + spares
    assert cache._blocks.held_bytes >= held + cache._blocks.extra_bytes
    assert cache._drop_point() and cache._blocks.extra_bytes == (points - 1) * engine.runner.state_layout.bytes + spares
    engine.clear_prefix_cache()
    assert not cache.points.points and cache._blocks.extra_bytes == spares
    a.close()


def test_the_server_keeps_the_state_where_the_newest_message_begins(engine):
    """A server request's prompt is cut where its newest message begins (Request.message_start), and the state there
    kept: a second request with the same start adopts the blocks and that state, and its tokens equal a run of it
    with nothing cached."""
    from kvchat.engine.serve.scheduler import Request, Scheduler, SchedulerConfig, TokenOut

    def run(sched, prompt, start):
        """The request's tokens, and the prompt tokens it read (the rest came from the cache)."""
        out, fin = [], []
        sched.submit(Request(prompt, SamplingParams(temperature=0.0, max_new_tokens=6),
                             lambda e: out.append(e.token_id) if isinstance(e, TokenOut) else fin.append(e),
                             message_start=start))
        before = engine.runner.tokens_read
        while not fin:
            sched.step()
        return out, engine.runner.tokens_read - before - (len(out) - 1)

    shared = IDS[:54]                           # chunks of 32 end at 32 and 64; the message begins at 54
    sched = Scheduler(engine, SchedulerConfig(FP32.with_(budget_mb=64), 4, prefill_chunk=32))
    engine.clear_prefix_cache()
    run(sched, shared + IDS[100:110], 54)
    second, read = run(sched, shared + IDS[120:135], 54)
    assert read == 69 - 48                      # from the block boundary before the message on (not 32's)
    engine.clear_prefix_cache()
    alone, read = run(sched, shared + IDS[120:135], 54)
    assert read == 69 and alone == second
