"""Replaying a conversation under another cache mode (engine/runtime/replay.py, `kvchat replay`): a text's figures are
`kvchat bench quality`'s, a chat's replies are found where the session put them, the first parting is where the
greedy choices part, and a replay leaves the pool and the open chat as they were, cancelled or not."""
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


@pytest.fixture(scope="module")
def packed():
    """The default model's packed weights: the C decode path, fast enough to replay token by token."""
    from kvchat.engine import Engine, EngineConfig
    return Engine.load(EngineConfig(model="default"))


def prose(engine, n: int) -> list[int]:
    return load_tokens(engine.tokenizer, "prose", n)


def test_a_texts_figures_are_bench_qualitys(packed):
    """The same 64 tokens under int4: top-1 and KL equal compare_modes' (kvchat bench quality's)."""
    ids = prose(packed, 64)
    got = replay(packed, ids, INT4, FP32)
    want = compare_modes(packed, ids, {"int4": INT4})["int4"]
    assert got.tokens == want["tokens"] == 64 and got.replies == ()
    assert abs(got.top1 - want["top1_agreement"]) < 1e-9 and abs(got.kl - want["mean_kl"]) < 1e-6


def test_the_chats_own_mode_never_parts_and_a_window_does(packed):
    """Replayed under its own mode the replies agree everywhere; under window 16 + 4 sinks they part, and the first
    parting is the first position whose greedy choices differ."""
    s = packed.new_session(cache=FP32)
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    s.reply("Tell me about the printing press.", params)
    s.reply("And about paper?", params)
    ids, replies = conversation_tokens(packed, None, s.messages)
    assert [i for i, _, _ in replies] == [1, 3]
    assert [start for _, start, _ in replies] == [s.state.starts[1], s.state.starts[3]]
    assert ids[:replies[-1][2]] == s.token_ids[:replies[-1][2]]
    same = replay(packed, ids, FP32, FP32, replies)
    assert same.top1 == 1.0 and same.kl < 1e-9 and same.first_divergence is None
    assert [r.index for r in same.replies] == [1, 3] and all(r.tokens == r.end - r.start for r in same.replies)
    slid = replay(packed, ids, FP32.with_(window=16, sinks=4), FP32, replies)
    assert slid.top1 < 1.0
    first = next(r for r in slid.replies if r.first_divergence is not None)
    assert first.start <= first.first_divergence < first.end and first.expected != first.replayed
    assert slid.first_divergence == first.first_divergence
    s.close()


def test_a_replay_leaves_the_pool_and_the_chat_as_they_were_even_cancelled(packed):
    """After a replay, and one cancelled at its third step, the pool holds what it held (blocks left only for
    prefix reuse aside) and the open chat has the same tokens and messages."""
    runner = packed.runner
    s = packed.new_session()
    s.reply("Hello there", SamplingParams(temperature=0.0, max_new_tokens=8))
    runner.clear_prefix_cache()
    held, tokens, messages = runner.held_bytes, list(s.token_ids), [dict(m) for m in s.messages]
    replay(packed, s.token_ids, INT4, s.cache_config)
    seen = []
    with pytest.raises(Cancelled):
        replay(packed, s.token_ids, INT4, s.cache_config, should_stop=lambda: len(seen) >= 3,
               progress=lambda done, total: seen.append(done))
    assert seen == [1, 2, 3]
    runner.clear_prefix_cache()
    assert runner.held_bytes == held and s.token_ids == tokens and s.messages == messages
    s.close()


def test_what_cannot_be_replayed_is_refused_before_it_starts(packed):
    """A budget too small for both sessions, a chat past the context without a window, nothing to replay."""
    held = packed.runner.held_bytes
    with pytest.raises(ConfigError, match="budget"):
        check_replay_room(_small(packed), FP32, FP32, 4000)
    with pytest.raises(ConfigError, match="context"):
        check_replay_room(packed, FP32, INT4, 9000)
    with pytest.raises(ConfigError, match="nothing to replay"):
        replay(packed, [5], INT4, FP32)
    assert packed.runner.held_bytes == held


def _small(engine):
    class Small:                    # the engine's numbers, a 1 MiB budget
        model, dtype_name, device, budget_mb = engine.model, engine.dtype_name, engine.device, 1.0
    return Small()


# ---- the command ----------------------------------------------------------------------------------------------

def run_cli(capsys, *argv) -> tuple[int, str, str]:
    from kvchat.cli.terminal import main
    code = main(["replay", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_command_replays_a_text_file(packed, tmp_path, capsys):
    text = tmp_path / "prose.txt"
    text.write_text(packed.tokenizer.decode(prose(packed, 80)))
    code, out, err = run_cli(capsys, "--text", str(text), "--k-format", "int4", "--v-format", "int4",
                             "--tokens", "60", "--json")
    assert code == 0 and "60 / 60 tokens" in err
    got = json.loads(out)
    assert got["tokens"] == 60 and got["mode"] == "int4" and 0.5 < got["top1"] <= 1.0 and "replies" not in got


def test_the_command_replays_a_saved_chat(packed, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path))
    from kvchat.app.store.history import HistoryStore
    store = HistoryStore()
    cid = store.create("printing", FP32)
    s = packed.new_session(cache=FP32)
    s.reply("Tell me about the printing press.", SamplingParams(temperature=0.0, max_new_tokens=12))
    for m in s.messages:
        store.add_message(cid, m["role"], m["content"])
    store.close()
    s.close()
    code, out, _ = run_cli(capsys, "--conversation", str(cid), "--window", "16", "--sinks", "4", "--json")
    got = json.loads(out)
    assert code == 0 and got["baseline"] == FP32.label() and [r["index"] for r in got["replies"]] == [1]
    assert got["replies"][0]["tokens"] == got["tokens"]
    code, out, err = run_cli(capsys, "--conversation", "999", "--json")
    assert code == 2 and out == "" and "--list" in err
    code, out, _ = run_cli(capsys, "--list")
    assert code == 0 and f"{cid}" in out and "printing" in out


@pytest.mark.parametrize("content, says", [(None, "no such file"), (b"\x00\x01binary", "binary"), (b"  \n", "empty"),
                                           (b"\xff\xfe\xfa", "UTF-8")])
def test_the_command_refuses_bad_files_in_one_line(tmp_path, capsys, content, says):
    path = tmp_path / "in.txt"
    if content is not None:
        path.write_bytes(content)
    code, out, err = run_cli(capsys, "--text", str(path), "--json")
    assert code == 2 and out == "" and says in err and "Traceback" not in err
