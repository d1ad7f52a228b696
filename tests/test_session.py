"""Sessions: incremental multi-turn prefill, teacher forcing, sampling, streaming."""
import pytest
import torch

from kvchat.engine import SamplingParams, TokenDelta, TurnFinished
from kvchat.engine.runtime.sampling import sample

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)


def test_append_returns_teacher_forced_logits(tiny_engine):
    """append() returns one row of logits per token and equals one long append."""
    ids = list(range(5, 45))
    a = tiny_engine.new_session().append(ids)
    s = tiny_engine.new_session()
    b = torch.cat((s.append(ids[:17]), s.append(ids[17:])))
    assert a.shape == (40, tiny_engine.model.config.vocab_size)
    assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.slow
def test_turns_prefill_only_new_tokens_and_match_fresh_session(default_engine):
    """Turn 2 prefills only its new tokens and replies as a fresh session given the whole chat."""
    s = default_engine.new_session()
    s.reply("Name a colour.", GREEDY)
    held = s.seq.num_tokens
    events = list(s.send("And a fruit?", GREEDY))
    finished = events[-1]
    assert isinstance(finished, TurnFinished)
    # turn 2 prefills the pending end-of-turn token plus "<|im_end|>\n<|im_start|>user\nAnd a fruit?..." only
    delta = "\n<|im_start|>user\nAnd a fruit?<|im_end|>\n<|im_start|>assistant\n"
    expected = 1 + len(default_engine.tokenizer.encode(delta, add_special_tokens=False))
    assert finished.stats.prefill_tokens == expected
    assert held > 3 * expected
    fresh = default_engine.new_session(history=s.messages[:-2])
    assert fresh.reply("And a fruit?", GREEDY) == finished.text


@pytest.mark.slow
def test_terminal_answer_mentions_paris(default_engine):
    """The default model answers the capital question with Paris."""
    text = default_engine.new_session().reply("What is the capital of France?", GREEDY)
    assert "Paris" in text


def test_sampling_modes():
    """Greedy is argmax; top-k 1 is argmax; top-p keeps the smallest set; penalty lowers repeats."""
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])
    g = torch.Generator().manual_seed(0)
    assert sample(logits, SamplingParams(temperature=0), [], None) == 1
    assert all(sample(logits, SamplingParams(temperature=1.0, top_k=1), [], g) == 1 for _ in range(20))
    picks = {sample(logits, SamplingParams(temperature=1.0, top_p=0.5), [], g) for _ in range(50)}
    assert picks == {1}
    assert sample(logits, SamplingParams(temperature=0, repetition_penalty=2.0), [1], None) == 2
    picks = {sample(logits, SamplingParams(temperature=5.0), [], g) for _ in range(200)}
    assert picks == {0, 1, 2, 3}


def test_stream_decoder_never_splits_a_character(tiny_engine):
    """Byte-level tokens of multi-byte characters are emitted only once each character is whole."""
    from kvchat.engine.text.detok import StreamDecoder
    tok = tiny_engine.tokenizer
    text = "日本語 🙂 Ünïcödé"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) / 2            # the tiny vocabulary splits characters into bytes
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + dec.flush() == text


def test_stream_sums_to_reply(tiny_engine):
    """Streamed pieces concatenate to the final text."""
    s = tiny_engine.new_session()
    pieces, final = [], None
    for event in s.send("Ünïcödé 🙂 日本語", SamplingParams(temperature=1.5, max_new_tokens=60, seed=3)):
        if isinstance(event, TokenDelta):
            pieces.append(event.text)
        else:
            final = event
    assert isinstance(final, TurnFinished) and final.finish_reason in ("eos", "length") and final.text != ""
    assert "".join(pieces) == final.text


def test_stop_callback_ends_turn_within_one_step(tiny_engine):
    """should_stop is honoured before the next decode step and the partial reply is kept."""
    s = tiny_engine.new_session()
    seen = []

    def stop():
        return len(seen) >= 3

    for event in s.send("hello", SamplingParams(temperature=1.0, max_new_tokens=50, seed=1), should_stop=stop):
        if isinstance(event, TokenDelta):
            seen.append(event)
        else:
            final = event
    assert final.finish_reason in ("stopped", "eos")
    if final.finish_reason == "stopped":
        assert len(seen) <= 4
    assert s.messages[-1]["role"] == "assistant"


def test_reset_keeps_messages_and_next_turn_reprefills(tiny_engine):
    """reset() frees the cache but the conversation continues, re-prefilled from its messages."""
    s = tiny_engine.new_session()
    s.reply("one", SamplingParams(temperature=0, max_new_tokens=5))
    s.reset()
    assert s.stats().kv_bytes == 0 and len(s.messages) == 2
    events = list(s.send("two", SamplingParams(temperature=0, max_new_tokens=5)))
    assert events[-1].stats.prefill_tokens > 8
    assert len(s.messages) == 4


def test_context_limit_stops_turn_and_window_continues(tmp_path):
    """Past the model's context a turn ends with advice; the chat is intact and a window lets it go on."""
    from kvchat.engine import CacheConfig, Engine, EngineConfig
    from tiny_models import tiny_model_dir
    engine = Engine.load(EngineConfig(model=tiny_model_dir(tmp_path, max_positions=64)))
    s = engine.new_session()
    events = list(s.send("hello " * 80, SamplingParams(temperature=0, max_new_tokens=4)))
    final = events[-1]
    assert final.finish_reason == "context" and "sliding window" in final.message
    assert s.messages == [] and s.stats().kv_bytes == 0
    s.set_cache(CacheConfig(window=32, sinks=4))
    final = list(s.send("hello " * 80, SamplingParams(temperature=0, max_new_tokens=4)))[-1]
    assert final.finish_reason in ("length", "eos") and len(s.messages) == 2
