"""Warm conversations (issue 25): a conversation's KV saved to disk and read back instead of its text.

The next logits after a restore equal, bit for bit, those of the session that never left memory: every cache
format, a window with sinks, a hybrid (Gemma 3 shaped) model and the default model's GGUF. A missing, truncated,
damaged, foreign, mismatched or crafted file is refused with a reason, and the conversation is read again
unharmed. The budget's release of an idle conversation saves it first (the second tier of a host pool), and its
next turn reads the file back. The store keeps to its disk budget, least recently used first out."""
from __future__ import annotations

import json
import os

import pytest
import torch

from kvchat.engine import CacheConfig, Engine, EngineConfig, SamplingParams, SpeculativeConfig
from kvchat.engine.kv import saved
from kvchat.engine.runtime.warm import CacheFileError, WarmStore

G = SamplingParams(temperature=0, max_new_tokens=12)
MODES = {
    "fp32": CacheConfig(k_format="fp32", v_format="fp32"),
    "bf16": CacheConfig(k_format="bf16", v_format="bf16"),
    "int8": CacheConfig(k_format="int8", v_format="int8"),
    "fp8": CacheConfig(k_format="fp8", v_format="fp8"),
    "int4": CacheConfig(k_format="int4", v_format="int4"),
    "int8-int4-window": CacheConfig(k_format="int8", v_format="int4", window=32, sinks=4),
    "fp32-window": CacheConfig(k_format="fp32", v_format="fp32", window=24, sinks=4),
}


def chat(engine, cache, key="c1", turns=("Hello there, how are you doing today?", "Tell me more about the sea"),
         prefix_cache=True):
    s = engine.new_session(cache=cache, prefix_cache=prefix_cache)
    engine.keep_warm(s, key)
    for text in turns:
        s.reply(text, G)
    return s


def reopened(engine, s, key="c1"):
    """A new session on the same conversation, as the app makes after a restart."""
    s2 = engine.new_session(cache=s.cache_config, history=s.messages)
    engine.keep_warm(s2, key)
    return s2


def same_next(s, s2) -> bool:
    """The next logits, of a prompt's rows and of a decode row after them, bit for bit."""
    a, b = s.append([5, 6, 7, 8]), s2.append([5, 6, 7, 8])
    return torch.equal(a, b) and torch.equal(s.append([9]), s2.append([9]))


@pytest.fixture
def tiny(tiny_engine, tmp_path):
    # plain decoding: how many drafts prompt lookup proposes follows the step costs it times, so on a loaded machine
    # two chats of the same words can write their rows in other verification batches (same tokens, other last bits),
    # and the bit-for-bit comparisons below are between a restored chat and one computed again
    spec = tiny_engine.speculative
    tiny_engine.set_speculative(SpeculativeConfig("off"))
    tiny_engine._warm_store = WarmStore(tmp_path / "kv")
    yield tiny_engine
    tiny_engine._warm_store = None
    tiny_engine.set_speculative(spec)


@pytest.mark.parametrize("mode", list(MODES))
def test_restored_cache_gives_the_same_next_logits_bit_for_bit(tiny, mode):
    s = chat(tiny, MODES[mode])
    held = s.seq.num_tokens
    assert tiny.save_warm(s) > 0
    s2 = reopened(tiny, s)
    got = tiny.restore_warm(s2)
    assert got.tokens == held and s2.seq.num_tokens == held and s2.token_ids == s.token_ids
    assert s2.stats().kv_bytes == s.stats().kv_bytes
    # a restored chat regenerates by forking where its last reply began, as one that stayed does
    s3 = reopened(tiny, s)
    tiny.restore_warm(s3)
    assert torch.equal(s3.state.prompt_logits, s.state.prompt_logits)
    stayed = chat(tiny, MODES[mode], key="other", prefix_cache=False)    # computed as `s` was, step for step
    assert list(stayed.regenerate(G))[-1].text == list(s3.regenerate(G))[-1].text
    if MODES[mode].window is None:      # a window that slid reads the prompt again (prefix hits may differ)
        assert s3.turn_times.prefill_tokens == stayed.turn_times.prefill_tokens   # 0, or a partial quantized block
        assert torch.equal(stayed.append([9, 10]), s3.append([9, 10]))
    assert same_next(s, s2)
    tiny.runner.cache.check()
    for x in (s, s2, s3, stayed):
        x.close()


def test_file_bytes_per_token_follow_the_format(tiny):
    sizes = {}
    for mode in ("fp32", "bf16", "int8", "int4"):
        s = chat(tiny, MODES[mode], key=mode, turns=("word " * 150,))
        sizes[mode] = tiny.save_warm(s) / s.seq.num_tokens
        s.close()
    assert sizes["fp32"] > 1.8 * sizes["bf16"] > 1.8 * 0.9 * sizes["int8"]
    assert sizes["int4"] < sizes["int8"] < sizes["bf16"]


def test_a_hybrid_model_restores_every_group(tmp_path):
    from tiny_models import tiny_family_dir
    engine = Engine.load(EngineConfig(model=tiny_family_dir(tmp_path / "g3", "gemma3")))
    engine._warm_store = WarmStore(tmp_path / "kv")
    ids = torch.randint(3, 300, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    for cache in (MODES["fp32"], MODES["int8"]):
        s = engine.new_session(cache=cache)
        engine.keep_warm(s, "h")
        s.append(ids)
        assert len(s.seq.members) == 2 and s.seq.members[1].evicted > 0     # the sliding group let blocks go
        engine.save_warm(s)
        s2 = engine.new_session(cache=cache)
        engine.keep_warm(s2, "h")
        engine.restore_warm(s2)
        assert [m.seq_len for m in s2.seq.members] == [m.seq_len for m in s.seq.members]
        assert torch.equal(s.append([7, 8, 9]), s2.append([7, 8, 9]))
        engine.runner.cache.check()
        s.close()
        s2.close()


def test_the_default_models_gguf_restores(default_gguf_engine, tmp_path):
    e = default_gguf_engine
    e._warm_store = WarmStore(tmp_path / "kv")
    try:
        identity = e.model_identity
        assert identity["size"] > 0 and len(identity["header_sha256"]) == 64 and identity["name"].endswith(".gguf")
        s = chat(e, CacheConfig(k_format="int8", v_format="int8"), turns=("Name three colours.",))
        e.save_warm(s)
        s2 = reopened(e, s)
        e.restore_warm(s2)
        assert same_next(s, s2)
        s.close()
        s2.close()
    finally:
        e._warm_store = None


@pytest.fixture(scope="module")
def default_gguf_engine():
    return Engine.load(EngineConfig(model="default"))


# ---- refusals: each says why, and the conversation is read again unharmed -----------------------------------

def refused(engine, s, key="c1") -> tuple[str, object]:
    s2 = reopened(engine, s, key)
    with pytest.raises(CacheFileError) as info:
        engine.restore_warm(s2)
    assert s2.seq.num_tokens == 0 and s2.token_ids == []
    engine.runner.cache.check()
    want = engine.new_session(cache=s.cache_config, history=s.messages)
    assert s2.reply("and then?", G) == want.reply("and then?", G)      # read again, same reply
    want.close()
    s2.close()
    return str(info.value), s2


def test_a_missing_file_is_refused(tiny):
    s = chat(tiny, MODES["int8"])
    assert "no saved cache" in refused(tiny, s)[0]


@pytest.mark.parametrize("damage", ["truncate", "flip", "junk", "empty"])
def test_damaged_files_are_refused(tiny, damage):
    s = chat(tiny, MODES["int8"])
    tiny.save_warm(s)
    path = tiny.warm_store.path("c1", tiny.model_identity)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "flip":
        data[-100] ^= 0x40
    elif damage == "junk":
        data = bytearray(os.urandom(4000))
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    why = refused(tiny, s)[0]
    assert "damaged" in why or "truncated" in why or "checksum" in why


def _rewrite(path, edit_meta=None, edit_tensors=None):
    """Rewrite a saved file with changed metadata or tensors and a *valid* checksum: what a crafted file can do."""
    meta, tensors = saved.read(path, 1 << 40)
    if edit_meta:
        edit_meta(meta)
    if edit_tensors:
        edit_tensors(tensors)
    meta.pop("version")
    saved.write(path, meta, tensors)


def test_a_file_saved_with_the_older_sha256_checksum_still_opens(tiny):
    """Files saved before the c64 checksum carry SHA-256 over every byte: read as they are. And the c64 lanes (C,
    AVX-512 / AVX2 / plain loops) are numpy's reference lanes, for any length."""
    from kvchat.kernels import cpu_quant
    s = chat(tiny, MODES["int8"])
    tiny.save_warm(s)
    path = tiny.warm_store.path("c1", tiny.model_identity)
    meta, tensors = saved.read(path, 1 << 40)
    from safetensors.torch import save
    body = json.dumps(meta, sort_keys=True)
    path.write_bytes(save(tensors, {"kvchat": body, "sha256": saved._digest(body, tensors, "sha256")}))
    s2 = reopened(tiny, s)
    assert tiny.restore_warm(s2).tokens == s.seq.num_tokens and same_next(s, s2)
    for n in (0, 5, 64, 1000, 4099, (3 << 18) + 37):      # the last read in parts by two threads
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
        assert cpu_quant.checksum(raw) == cpu_quant.checksum_ref(raw.numpy())
    flipped = raw.clone()
    flipped[(3 << 18) - 7] ^= 1                                 # in the second part
    assert cpu_quant.checksum(flipped) != cpu_quant.checksum(raw)
    # finiteness the same way: a NaN or an infinity in any part of a large tensor
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(1 << 20).to(dtype)
        assert cpu_quant.all_finite(x)
        for at, bad in ((5, float("nan")), ((1 << 20) - 3, float("inf")), (1 << 19, float("-inf"))):
            y = x.clone()
            y[at] = bad
            assert cpu_quant.all_finite(y) is False, (dtype, at)


@pytest.mark.parametrize("craft", ["huge_counts", "blocks_mismatch", "wrong_shape", "extra_tensor", "bad_tokens",
                                   "version", "not_a_count", "missing_pages"])
def test_crafted_files_with_a_valid_checksum_are_refused(tiny, craft):
    s = chat(tiny, MODES["int4"])
    tiny.save_warm(s)
    path = tiny.warm_store.path("c1", tiny.model_identity)
    edits = {
        "huge_counts": dict(edit_meta=lambda m: m["groups"][0].update(num_tokens=10**12, blocks=10**12 // 16)),
        "blocks_mismatch": dict(edit_meta=lambda m: m["groups"][0].update(blocks=m["groups"][0]["blocks"] + 1)),
        "wrong_shape": dict(edit_tensors=lambda t: t.update({"g0.l0.k.data": torch.zeros(10**3, 4, dtype=torch.uint8)})),
        "extra_tensor": dict(edit_tensors=lambda t: t.update({"evil": torch.zeros(3)})),
        "bad_tokens": dict(edit_tensors=lambda t: t.update({"token_ids": torch.full((5,), 10**9, dtype=torch.int64)})),
        "version": None,
        "not_a_count": dict(edit_meta=lambda m: m["groups"][0].update(evicted="many")),
        "missing_pages": dict(edit_tensors=lambda t: t.pop("g0.l1.v.data")),
    }
    if craft == "version":
        meta, tensors = saved.read(path, 1 << 40)
        from safetensors.torch import save
        body = json.dumps({**meta, "version": 99}, sort_keys=True)
        path.write_bytes(save(tensors, {"kvchat": body, "checksum": "c64:" + saved._digest(body, tensors)}))
    else:
        _rewrite(path, **edits[craft])
    why = refused(tiny, s)[0]
    assert why and len(why) < 200


def test_another_model_mode_or_edited_chat_is_refused(tiny):
    s = chat(tiny, MODES["int8"])
    tiny.save_warm(s)
    path = tiny.warm_store.path("c1", tiny.model_identity)
    # another model file: the same file name under another identity
    _rewrite(path, edit_meta=lambda m: m["model"].update(header_sha256="0" * 64))
    assert "another model" in refused(tiny, s)[0]
    # another cache mode
    tiny.save_warm(s)
    s2 = tiny.new_session(cache=MODES["int4"], history=s.messages)
    tiny.keep_warm(s2, "c1")
    with pytest.raises(CacheFileError, match="another cache mode"):
        tiny.restore_warm(s2)
    s2.close()
    # the chat was edited since (the history the app reopens differs from what the cache holds)
    tiny.save_warm(s)
    edited = [dict(m) for m in s.messages]
    edited[0]["content"] = "Something else entirely"
    s3 = tiny.new_session(cache=s.cache_config, history=edited)
    tiny.keep_warm(s3, "c1")
    with pytest.raises(CacheFileError, match="changed since"):
        tiny.restore_warm(s3)
    assert s3.seq.num_tokens == 0
    s3.close()


def test_a_cache_larger_than_the_budget_is_refused_and_nothing_is_held(tiny):
    s = chat(tiny, MODES["fp32"], turns=("word " * 120,))
    tiny.save_warm(s)
    s.close()
    before = tiny.runner.budget_bytes
    tiny.runner.set_budget(0.05)
    try:
        s2 = tiny.new_session(cache=MODES["fp32"].with_(budget_mb=0.05), history=s.messages)
        tiny.keep_warm(s2, "c1")
        with pytest.raises(CacheFileError):
            tiny.restore_warm(s2)
        assert s2.seq.num_tokens == 0 and not s2.seq.block_table
        tiny.runner.cache.check()
        s2.close()
    finally:
        tiny.runner.set_budget(before / 2**20)


# ---- the second tier: released for room -> saved, then read back --------------------------------------------

def released_chat(tiny, cache):
    """A warm chat `a` of one long turn, the logits its twin (never released) gives next, and the budget cut to
    room for about one such chat: the next chat of that size releases `a`."""
    twin = tiny.new_session(cache=cache, prefix_cache=False)
    twin.reply("word " * 60, G)
    want = twin.append([5, 6, 7])
    twin.close()
    tiny.clear_prefix_cache()
    a = chat(tiny, cache, key="a", turns=("word " * 60,))
    small = cache.with_(budget_mb=tiny.runner.held_bytes * 1.3 / 2**20)
    tiny.runner.set_budget(small.budget_mb)
    return a, want, small


def crowd_out(tiny, a, small):
    b = tiny.new_session(cache=small, prefix_cache=False)
    b.append([10 + i % 300 for i in range(a.seq.num_tokens)])              # no room for both: `a` is released
    return b


def test_a_released_conversation_is_saved_and_read_back_on_its_next_turn(tiny_llama, tmp_path):
    tiny = Engine.load(EngineConfig(model=tiny_llama))            # a pool of its own: `a` is the only idle chat
    tiny._warm_store = WarmStore(tmp_path / "kv")
    budget = tiny.runner.budget_bytes
    a, want, small = released_chat(tiny, MODES["fp32"])
    try:
        crowd_out(tiny, a, small).close()
        assert a.seq.num_tokens == 0 and a.tier == "disk" and tiny.runner.offloaded >= 1
        got = a.append([5, 6, 7])          # its next turn reads the file back, not the text
        assert "read back from disk" in a.notice and a.tier == "pool"
        assert torch.equal(got, want)
    finally:
        tiny.runner.set_budget(budget / 2**20)
        a.close()


@pytest.mark.parametrize("mode", ["fp32", "int8"])
def test_a_gpu_pools_released_conversation_goes_to_host_memory_and_back(tiny_llama, tmp_path, mode):
    """Beside a GPU pool the second tier is host memory (runner.host_tier; pinned there): here a CPU engine given
    that tier, which is all a GPU pool adds. Released for room, the chat's cache goes there, not to disk, and
    comes back on its next turn with the bits of a chat never released; a reset drops the copy."""
    from kvchat.engine.kv.tier import PreemptTier
    tiny = Engine.load(EngineConfig(model=tiny_llama))
    tiny._warm_store = WarmStore(tmp_path / "kv")
    tiny.runner.cache.host_tier = PreemptTier(64, "host")
    budget = tiny.runner.budget_bytes
    a, want, small = released_chat(tiny, MODES[mode])
    try:
        crowd_out(tiny, a, small).close()
        assert a.seq.num_tokens == 0 and a.tier == "host" and len(tiny.runner.host_tier) == 1
        assert tiny.warm_store.files() == []                                    # not written to disk
        got = a.append([5, 6, 7])
        assert "read back from host memory" in a.notice and a.tier == "pool"
        assert torch.equal(got, want)
        assert len(tiny.runner.host_tier) == 0
        c = crowd_out(tiny, a, small)                                           # released again, then reset
        assert a.tier == "host"
        a.reset()
        assert len(tiny.runner.host_tier) == 0 and a.tier == "pool"
        c.close()
    finally:
        tiny.runner.set_budget(budget / 2**20)
        a.close()


def test_reset_deletes_the_saved_cache(tiny):
    s = chat(tiny, MODES["int8"])
    written = tiny.save_warm(s)
    assert tiny.warm_store.files()
    pool = s.pool_stats()           # the Pool page's second tier: what is on disk beside its budget
    assert (pool.saved_files, pool.saved_bytes, pool.saved_budget_bytes) == (1, written, tiny.warm_store.budget_bytes)
    s.reset()
    assert tiny.warm_store.files() == [] and s.pool_stats().saved_files == 0
    s.close()


def test_the_store_keeps_to_its_disk_budget_least_recently_used_first(tiny, tmp_path):
    sizes = {}
    for key in ("x", "y", "z"):
        s = chat(tiny, MODES["fp32"], key=key, turns=("word " * 40,))
        sizes[key] = tiny.save_warm(s)
        s.close()
        os.utime(tiny.warm_store.path(key, tiny.model_identity), (1000 + len(sizes), 1000 + len(sizes)))
    store = tiny.warm_store
    store.budget_bytes = sizes["y"] + sizes["z"] + 10
    assert store.trim() == sizes["x"]
    assert sorted(p.name.split("-")[0] for p in store.files()) == ["y", "z"]
    assert store.delete("y") == sizes["y"] and store.total_bytes() == sizes["z"]
    # a cache larger than the whole budget is not kept
    store.budget_bytes = 100
    s = chat(tiny, MODES["fp32"], key="big", turns=("word " * 40,))
    assert tiny.save_warm(s) == 0 and not store.path("big", tiny.model_identity).exists()
    s.close()
    assert store.clear() >= 0 and store.files() == []


def test_keys_cannot_escape_the_folder_or_collide(tiny):
    store, ident = tiny.warm_store, tiny.model_identity
    p = store.path("../../etc/passwd", ident)
    assert p.parent == store.folder and "/" not in p.name
    assert not store.path("1", ident).name.startswith(store.path("1-2", ident).name.split("-")[0] + "-2")
    s = chat(tiny, MODES["fp32"], key="1-2")
    tiny.save_warm(s)
    assert store.delete("1") == 0 and len(store.files()) == 1
    s.close()


def _raw(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + body


@pytest.mark.parametrize("craft", ["past_end", "size_mismatch", "negative_dim", "unknown_dtype", "header_too_long",
                                   "not_a_dict", "offsets_not_numbers"])
def test_crafted_headers_are_refused_before_any_tensor_is_made(tmp_path, craft):
    """saved.read parses the file's header itself (its tensors are views of the bytes read, no copy): every entry's
    type, shape and byte range is checked, and a crafted one is a CacheFileError, never a crash or a read past the
    end."""
    entry = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    headers = {
        "past_end": {"t": {**entry, "data_offsets": [0, 64]}},
        "size_mismatch": {"t": {**entry, "shape": [3]}},
        "negative_dim": {"t": {**entry, "shape": [-4]}},
        "unknown_dtype": {"t": {**entry, "dtype": "Q4"}},
        "header_too_long": None,
        "not_a_dict": [1, 2],
        "offsets_not_numbers": {"t": {**entry, "data_offsets": ["a", 16]}},
    }
    path = tmp_path / "crafted.kv"
    if craft == "header_too_long":
        path.write_bytes((10**9).to_bytes(8, "little") + b"{}" + bytes(16))
    else:
        path.write_bytes(_raw(headers[craft], bytes(16)))
    with pytest.raises(saved.CacheFileError):
        saved.read(path, 1 << 30)


def test_a_tensor_at_an_odd_offset_is_read_as_a_copy(tmp_path):
    """A valid file whose tensor does not start at a multiple of its type's size (safetensors never writes one) is
    still read, value for value."""
    header = {"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]}}
    text = json.dumps(header).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    body = bytes([1, 2, 3]) + torch.tensor([1.5, -2.0]).numpy().tobytes()
    data = bytearray(len(text).to_bytes(8, "little") + text + body)
    got_header, tensors = saved._tensors(data)
    assert tensors["a"].tolist() == [1, 2, 3] and tensors["b"].tolist() == [1.5, -2.0]


def test_a_restore_into_scattered_blocks_is_the_same_as_into_consecutive_ones(tiny):
    """A fresh pool gives a restored conversation consecutive block ids (one plain copy a tensor); a pool with holes
    between other conversations' blocks scatters them (the indexed copy). Both give the same next logits."""
    s = chat(tiny, MODES["bf16"])
    tiny.save_warm(s)
    fillers = [chat(tiny, MODES["bf16"], key=f"f{i}", turns=("word " * 40,)) for i in range(4)]
    for f in fillers[::2]:
        f.close()                   # holes between the fillers that stay
    s2 = reopened(tiny, s)
    tiny.restore_warm(s2)
    assert saved._run_of(s2.seq.block_table) is None, "the test meant to scatter the restored blocks"
    assert saved._run_of([3, 4, 5]) == slice(3, 6) and saved._run_of([3, 5, 6]) is None
    assert same_next(s, s2)
    tiny.runner.cache.check()
    for x in (s, s2, *fillers[1::2]):
        x.close()


def test_the_file_is_read_in_parts_and_a_file_that_grew_or_shrank_is_seen(tmp_path, monkeypatch):
    """_read_parts: threads reading side by side give the file's bytes; one byte more than measured, or fewer, shows
    in the count (the caller refuses the file: 'changed while it was read')."""
    monkeypatch.setattr(saved, "_PART", 4096)
    data = os.urandom(50_000)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for size, want in ((50_000, 50_000), (49_000, 49_001), (60_000, 50_000)):
            buf = bytearray(size + 1)
            assert saved._read_parts(fd, memoryview(buf), size) == want, size
            assert bytes(buf[:min(size, 50_000)]) == data[:min(size, 50_000)]
    finally:
        os.close(fd)
