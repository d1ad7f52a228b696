"""Saved KV caches that are not what they seem (issue 37, items 15 and 19): a FIFO or a link at a chat's saved-cache
path, NaN or inf pages, scales and logits under a valid checksum, and a description nested 100,000 deep. Each is
refused promptly with a reason, in a restore and in a turn that reads a released chat back, and the conversation is
read again; values a block never held (past its last token) do not count against a file."""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
import torch

from kvchat.engine import Engine, EngineConfig
from kvchat.engine.kv import saved
from kvchat.engine.runtime.warm import CacheFileError, WarmStore
from test_warm import G, MODES, _rewrite, chat, crowd_out, refused, released_chat, reopened, same_next, tiny  # noqa: F401

BLOCKED_S = 8          # a FIFO's writer turns up after this long: an open() that blocks fails on time, not by hanging


def _fifo_in_place(path):
    """A FIFO where the saved cache was, and a writer that opens it after BLOCKED_S (freeing a blocked reader)."""
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return subprocess.Popen(["sh", "-c", f'sleep {BLOCKED_S}; exec 3>"$0"', str(path)])


def test_a_fifo_at_the_saved_path_is_refused_at_once(tiny):
    s = chat(tiny, MODES["int8"])
    tiny.save_warm(s)
    writer = _fifo_in_place(tiny.warm_store.path("c1", tiny.model_identity))
    try:
        started = time.monotonic()
        why = refused(tiny, s)[0]
        assert time.monotonic() - started < BLOCKED_S - 2
    finally:
        writer.kill()
        writer.wait()
    assert "not a regular file" in why


def test_a_link_at_the_saved_path_is_refused(tiny):
    s = chat(tiny, MODES["int8"])
    tiny.save_warm(s)
    path = tiny.warm_store.path("c1", tiny.model_identity)
    elsewhere = path.with_name("elsewhere.bin")
    path.rename(elsewhere)
    path.symlink_to(elsewhere)                     # a valid cache, but not at its own path: not followed
    assert "link" in refused(tiny, s)[0]


def _deep_description(path):
    """The file's description with a key nested 100,000 deep, under a valid checksum (json.dumps cannot write it)."""
    meta, tensors = saved.read(path, 1 << 40)
    body = json.dumps({**meta}, sort_keys=True)
    body = '{"deep": ' + "[" * 100_000 + "]" * 100_000 + ", " + body[1:]
    from safetensors.torch import save
    path.write_bytes(save(tensors, {"kvchat": body, "checksum": "c64:" + saved._digest(body, tensors)}))


def _set(name, value, rows=slice(None)):
    def edit(tensors):
        t = tensors[name]
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8)[rows] = 0x7F                        # e4m3fn's NaN
        else:
            t[rows] = value
    return edit


NAN, INF = float("nan"), float("inf")
CRAFTS = {   # mode, edit of the tensors (a valid checksum follows), or a whole-file craft
    "nan_page_fp32": ("fp32", _set("g0.l0.k.data", NAN, (0, 0))),
    "inf_page_bf16": ("bf16", _set("g0.l2.v.data", -INF, (0, 1))),
    "nan_page_fp8": ("fp8", _set("g0.l1.k.data", NAN, 1)),
    "inf_scale_int8": ("int8", _set("g0.l0.v.scale", INF, 1)),
    "nan_zero_int4": ("int4", _set("g0.l0.k.zero", NAN, 1)),
    "nan_tail_int8": ("int8", _set("g0.l1.k.tail", NAN, 0)),
    "inf_head_int4": ("int4", _set("g0.l0.v.head", INF, 2)),
    "nan_logits": ("fp32", _set("prompt_logits", NAN, 7)),
    "deep_description": ("int8", None),
}


@pytest.mark.parametrize("craft", sorted(CRAFTS))
def test_non_finite_values_or_a_depth_bomb_under_a_valid_checksum_are_refused(tiny, craft):
    mode, edit = CRAFTS[craft]
    s = chat(tiny, MODES[mode])
    assert s.seq.num_tokens >= 3 * s.seq.block_size          # full blocks past block 0, whose head stands in for it
    tiny.save_warm(s)
    path = tiny.warm_store.path("c1", tiny.model_identity)
    if edit is None:
        _deep_description(path)
    else:
        _rewrite(path, edit_tensors=edit)
    if mode == "fp8":           # fp8 is not read again bit for bit (seen with a missing file too): refusal only
        s2 = reopened(tiny, s)
        with pytest.raises(CacheFileError) as info:
            tiny.restore_warm(s2)
        assert s2.seq.num_tokens == 0 and s2.token_ids == []
        tiny.runner.cache.check()
        s2.close()
        why = str(info.value)
    else:
        why = refused(tiny, s)[0]
    assert ("not finite" if edit else "description is damaged") in why and len(why) < 200


def test_values_past_a_blocks_last_token_do_not_count(tiny):
    """The rows of the last block past the conversation's end were never written (they may hold anything): NaN
    there is no reason to refuse, and the restored chat goes on bit for bit."""
    s = chat(tiny, MODES["fp32"])
    bs, n = s.seq.block_size, s.seq.num_tokens
    assert n % bs
    tiny.save_warm(s)
    path = tiny.warm_store.path("c1", tiny.model_identity)
    last = len(s.seq.block_table) - 1
    _rewrite(path, edit_tensors=_set("g0.l0.k.data", NAN, (last, slice(n % bs, None))))
    s2 = reopened(tiny, s)
    assert tiny.restore_warm(s2).tokens == n
    assert same_next(s, s2)
    s2.close()


@pytest.mark.parametrize("damage", ["fifo", "deep_description", "nan_page"])
def test_a_released_chat_whose_file_went_bad_is_read_again_on_its_next_turn(tiny_llama, tmp_path, damage):
    """The second tier, inside a turn (send -> Session._sync -> warm.read_back): the file is refused at once with a
    reason in the notice, and the turn reads the history again, replying as a chat never released."""
    engine = Engine.load(EngineConfig(model=tiny_llama))
    engine._warm_store = WarmStore(tmp_path / "kv")
    budget = engine.runner.budget_bytes
    a, want, small = released_chat(engine, MODES["fp32"])
    writer = None
    try:
        crowd_out(engine, a, small).close()
        assert a.tier == "disk"
        path = engine.warm_store.path("a", engine.model_identity)
        if damage == "fifo":
            writer = _fifo_in_place(path)
        elif damage == "deep_description":
            _deep_description(path)
        else:
            _rewrite(path, edit_tensors=_set("g0.l1.v.data", NAN, (0, 3)))
        history = [dict(m) for m in a.messages]
        started = time.monotonic()
        got = a.reply("and then?", G)
        assert time.monotonic() - started < BLOCKED_S - 2
        assert "could not be read back" in a.notice and "history is read again" in a.notice
        reason = {"fifo": "not a regular file", "deep_description": "description is damaged",
                  "nan_page": "not finite"}[damage]
        assert reason in a.notice
        a.close()
        fresh = engine.new_session(cache=small, history=history)
        assert got == fresh.reply("and then?", G)
        fresh.close()
    finally:
        if writer is not None:
            writer.kill()
            writer.wait()
        engine.runner.set_budget(budget / 2**20)
        a.close()
