"""Replaying a conversation under another cache mode (engine/runtime/replay.py, `kvchat replay`): a text's figures are
`kvchat bench quality`'s, a chat's replies are found where the session put them, the first parting is where the
greedy choices part, a replay leaves the pool and the open chat as they were, cancelled or not, and what cannot be
replayed is refused in one line before anything runs."""
from __future__ import annotations

import json

import pytest

from kvchat.engine import CacheConfig, SamplingParams
from kvchat.engine.config import ConfigError
from kvchat.engine.runtime.fidelity import Cancelled, compare_modes
from kvchat.engine.runtime.replay import check_replay_room, conversation_tokens, replay
from kvchat.engine.text.samples import load_tokens

FP32 = CacheConfig(k_format="fp32", v_format="fp32")
INT4 = CacheConfig(k_format="int4", v_format="int4")
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)


@pytest.fixture(scope="module")
def packed():
    """The default model's packed weights (fp32): the C decode path, fast enough to replay token by token."""
    from kvchat.engine import Engine, EngineConfig
    engine = Engine.load(EngineConfig(model="default"))
    assert engine.dtype_name == "fp32"          # FP32 below is the engine's own full precision
    return engine


def prose(engine, n: int) -> list[int]:
    return load_tokens(engine.tokenizer, "prose", n)


def pool(engine) -> tuple:
    """What the pool holds for its conversations: their (id, blocks, bytes, released), and the bytes not kept only
    for prefix reuse."""
    view = engine.runner.pool_view()
    return view.sequences, view.held_bytes - view.evictable_bytes


def test_a_texts_figures_are_bench_qualitys(packed):
    """128 tokens of prose under int4, one token a step: top-1 and KL are compare_modes' (kvchat bench quality's)
    to the last bit, and the first parting is its first disagreeing position."""
    ids = prose(packed, 128)
    got = replay(packed, ids, INT4, FP32)
    want = compare_modes(packed, ids, {"int4": INT4})["int4"]
    assert got.tokens == want["tokens"] == 128 and got.replies == ()
    assert got.top1 == want["top1_agreement"] and got.kl == want["mean_kl"]
    assert got.mode == "int4" and got.baseline == "fp32" and got.kv_bytes < got.baseline_kv_bytes
    assert got.first_divergence is not None and got.expected != got.replayed


def test_replayed_under_its_own_mode_nothing_parts(packed):
    """The baseline's own mode against itself: every greedy choice agrees, KL is 0, no first parting."""
    same = replay(packed, prose(packed, 48), FP32, FP32, replies=[(0, 5, 20), (1, 30, 48)])
    assert same.top1 == 1.0 and same.kl == 0.0 and same.first_divergence is None and same.expected is None
    assert [(r.index, r.tokens, r.top1, r.first_divergence) for r in same.replies] == [(0, 15, 1.0, None),
                                                                                       (1, 18, 1.0, None)]


def test_a_window_parts_only_once_it_slid(packed):
    """Window 16 + 4 sinks over 96 tokens: the first 20 tokens' predictions see what full attention sees (they
    agree), and the first parting comes after them, inside the span that holds it."""
    ids = prose(packed, 96)
    slid = replay(packed, ids, FP32.with_(window=16, sinks=4), FP32, replies=[(0, 1, 21), (1, 21, 96)])
    before, after = slid.replies
    assert before.top1 == 1.0 and before.kl < 1e-6 and before.first_divergence is None
    assert after.top1 < 1.0 and 21 <= after.first_divergence < 96 and after.expected != after.replayed
    assert (slid.first_divergence, slid.expected, slid.replayed) == (after.first_divergence, after.expected,
                                                                       after.replayed)
    assert slid.tokens == 95 and slid.kv_bytes < slid.baseline_kv_bytes        # the window held less


def test_a_chats_replies_are_where_the_session_put_them(packed):
    """A two-turn chat rendered again: the same tokens as the session's, each reply starting where the session
    started it and ending after the end-of-turn token the model chose; under its own mode it never parts."""
    s = packed.new_session(cache=FP32)
    s.reply("Tell me about the printing press.", GREEDY)
    s.reply("And about paper?", GREEDY)
    ids, replies = conversation_tokens(packed, None, s.messages)
    assert [i for i, _, _ in replies] == [1, 3]
    assert [start for _, start, _ in replies] == [s.state.starts[1], s.state.starts[3]]
    first_end = replies[0][2]
    assert ids[:first_end] == s.token_ids[:first_end] and ids[first_end - 1] in packed.info.stop_ids
    s.close()
    same = replay(packed, ids, FP32, FP32, replies)
    assert same.top1 == 1.0 and same.first_divergence is None
    assert [(r.index, r.tokens) for r in same.replies] == [(i, e - s) for i, s, e in replies]
    assert same.tokens == sum(e - s for _, s, e in replies)


def test_a_replay_leaves_the_pool_and_the_chat_as_they_were_even_cancelled(packed):
    """After a replay, and one cancelled at its third step, no session of the replay holds anything (only blocks kept
    for prefix reuse remain, and clearing them gives the same bytes as before) and the open chat has the same
    tokens, messages and cache bytes."""
    runner = packed.runner
    s = packed.new_session()
    s.reply("Hello there", GREEDY)
    runner.clear_prefix_cache()
    before, chat = pool(packed), (list(s.token_ids), [dict(m) for m in s.messages], s.stats().kv_bytes)
    held = runner.held_bytes
    replay(packed, s.token_ids, INT4, s.cache_config)
    assert pool(packed) == before
    seen = []
    with pytest.raises(Cancelled):
        replay(packed, s.token_ids, INT4, s.cache_config, should_stop=lambda: len(seen) >= 3,
               progress=lambda done, total: seen.append(done))
    assert seen == [1, 2, 3] and pool(packed) == before
    assert (s.token_ids, s.messages, s.stats().kv_bytes) == chat
    runner.clear_prefix_cache()
    assert runner.held_bytes == held
    s.close()


def test_what_cannot_be_replayed_is_refused_before_it_starts(packed):
    """Past the context without a window, a window longer than the context, nothing to replay, no reply within the
    tokens: a ConfigError naming what to change, with nothing opened in the pool."""
    before = pool(packed)
    with pytest.raises(ConfigError, match="past the model's 8,192-token context .*give it a window"):
        check_replay_room(packed, FP32, INT4, 9000)
    with pytest.raises(ConfigError, match="the replayed mode: window 9,000 .* use a window of at most"):
        check_replay_room(packed, FP32, FP32.with_(window=9000), 100)
    with pytest.raises(ConfigError, match="nothing to replay"):
        replay(packed, [5], INT4, FP32)
    with pytest.raises(ConfigError, match="none of the replies"):
        replay(packed, prose(packed, 20), INT4, FP32, replies=[(1, 30, 40)])
    assert pool(packed) == before


def test_the_budget_must_hold_both_sessions_beside_the_open_chat(packed):
    """Under an 8 MiB budget, 60 fp32 tokens twice fit alone, but not beside a chat holding about 3 MiB: the replay
    would release the chat, so it is refused and the chat keeps its cache."""
    runner, budget = packed.runner, packed.budget_mb
    runner.set_budget(8)
    try:
        check_replay_room(packed, FP32, FP32, 60)
        with pytest.raises(ConfigError, match=r"budget \(8 MiB\) cannot hold the replay: .*; raise the budget"):
            check_replay_room(packed, FP32, FP32, 170)
        s = packed.new_session(cache=FP32.with_(budget_mb=8))
        s.append(prose(packed, 60))
        with pytest.raises(ConfigError, match=r"beside the 2\.\d MiB the open chats hold"):
            replay(packed, prose(packed, 60), FP32, FP32)
        assert s.stats().kv_bytes > 0 and not s.seq.released
        s.close()
    finally:
        runner.set_budget(budget)


# ---- the command ----------------------------------------------------------------------------------------------

def run_cli(capsys, *argv) -> tuple[int, str, str]:
    from kvchat.cli.main import main
    code = main(["replay", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_command_replays_a_text_file(packed, tmp_path, capsys):
    """--text under int4, cut at --tokens (said on stderr): stdout is one JSON object with bench quality's figures;
    without --json, a summary."""
    text = tmp_path / "prose.txt"
    text.write_text(packed.tokenizer.decode(prose(packed, 80)))
    code, out, err = run_cli(capsys, "--text", str(text), "--k-format", "int4", "--v-format", "int4",
                             "--tokens", "60", "--json")
    assert code == 0 and "the first 60 are replayed" in err and "60 / 60 tokens" in err
    got = json.loads(out)
    ids = packed.tokenizer.encode(text.read_text(), add_special_tokens=False)[:60]
    want = compare_modes(packed, ids, {"int4": INT4})["int4"]
    assert (got["tokens"], got["mode"], got["baseline"]) == (60, "int4", "fp32") and "replies" not in got
    assert abs(got["top1"] - want["top1_agreement"]) < 1e-9 and got["baseline_from"].startswith("full precision")
    d = got["first_divergence"]
    assert d is None or (set(d) >= {"token", "expected", "replayed", "text"} and d["expected"] != d["replayed"])
    code, out, _ = run_cli(capsys, "--text", str(text), "--k-format", "int4", "--v-format", "int4", "--tokens", "40")
    assert code == 0 and out.startswith("int4 beside fp32 (full precision") and "over 40 positions" in out


def test_the_command_replays_a_saved_chat(packed, tmp_path, monkeypatch, capsys):
    """A chat saved through the app's store (int8): replayed under a window beside its saved mode, per reply; an
    unknown id is one line on stderr pointing at --list, nothing on stdout; --list shows the chat."""
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path))
    from kvchat.app.store.history import HistoryStore
    int8 = CacheConfig(k_format="int8", v_format="int8")
    store = HistoryStore()
    cid = store.create("printing", int8)
    s = packed.new_session(cache=int8)
    s.reply("Tell me about the printing press.", GREEDY)
    s.reply("And about paper?", GREEDY)
    for m in s.messages:
        store.add_message(cid, m["role"], m["content"])
    store.close()
    s.close()
    code, out, _ = run_cli(capsys, "--conversation", str(cid), "--window", "16", "--sinks", "4", "--json")
    got = json.loads(out)
    assert code == 0 and got["baseline"] == "int8" and got["baseline_from"] == "the chat's saved mode"
    assert [r["index"] for r in got["replies"]] == [1, 3] and got["mode"] == "auto, window 16 + 4 sinks"
    assert sum(r["tokens"] for r in got["replies"]) == got["tokens"] and got["top1"] < 1.0
    code, out, err = run_cli(capsys, "--conversation", "999", "--json")
    assert (code, out) == (2, "") and "--list" in err and len(err.strip().splitlines()) == 1
    code, out, _ = run_cli(capsys, "--list")
    assert code == 0 and f"{cid}" in out and "printing" in out


@pytest.mark.parametrize("content, says", [(None, "no such file"), ("dir", "not a file"),
                                           (b"\x00\x01binary", "binary"), (b"  \n", "empty"),
                                           (b"\xff\xfe\xfa", "UTF-8")])
def test_the_command_refuses_bad_files_in_one_line(tmp_path, capsys, content, says):
    path = tmp_path / "in.txt"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    code, out, err = run_cli(capsys, "--text", str(path), "--json")
    assert code == 2 and out == "" and says in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("options, says", [(["--window", "8"], "smaller than one block"),
                                           (["--k-format", "int3"], "not a cache format"),
                                           (["--baseline-v-format", "int3"], "the baseline: v_format"),
                                           (["--budget-mb", "4"], "raise the budget")])
def test_the_command_refuses_a_mode_or_budget_that_cannot_work(tmp_path, capsys, options, says):
    """An impossible mode, or a budget the replay does not fit in: one line, exit 2, nothing on stdout."""
    text = tmp_path / "in.txt"
    text.write_text("The printing press spread across Europe within a few decades. " * 20)
    code, out, err = run_cli(capsys, "--text", str(text), *options, "--json")
    lines = [line for line in err.splitlines() if not line.startswith("[replay]")]
    assert code == 2 and out == "" and says in err and len(lines) == 1 and lines[0].startswith("kvchat: ")
