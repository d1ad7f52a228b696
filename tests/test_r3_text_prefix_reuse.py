"""Issue 37 item 2: every chat format reuses its own prefix, and its saved cache is accepted on relaunch.

The chat rendered again must read as the tokens in the cache. The plain format (a model without a chat template)
wrote a reply " the" as "Assistant:  the" (two spaces) where the cache holds "Assistant: the", and its end-of-text
token, which that format does not write, made the cache look changed: every turn read the whole chat again and a
saved cache was refused on every relaunch. A tiny model whose weights are set so that it always answers " the" and
then ends its reply (as a real model's reply starts with a space after "Assistant:") runs in three formats: a chat
template (ChatML), the plain format of a folder without one, and a base model's GGUF without one."""
from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from kvchat.bench.gguf_hf import write_gguf_from_hf
from kvchat.engine import Engine, EngineConfig, SamplingParams
from kvchat.engine.runtime.warm import WarmStore
from tiny_models import tiny_model_dir

ENDS = SamplingParams(temperature=0, max_new_tokens=8)     # " the", then the end of text
ONE = SamplingParams(temperature=0, max_new_tokens=1)      # " the", cut at its one token


def answers_the(folder: Path) -> None:
    """Weights that make the model answer " the" and then end: the residual stream's dimension 0 is +10 for every
    token and dimension 1 is +10 after " the", -10 after any other (the layers write neither); the final norm keeps
    only these two, and the output rows read " the" from the first and the end of text from the second."""
    path = folder / "model.safetensors"
    w = load_file(path)
    the, eos = 264, 2                           # build_tokenizer's "Ġthe" and "<|im_end|>"
    emb = w["model.embed_tokens.weight"]
    emb[:, 0], emb[:, 1] = 10.0, -10.0
    emb[the, 1] = 10.0
    for name, t in w.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t[:2] = 0.0
    w["model.norm.weight"].zero_()
    w["model.norm.weight"][:2] = 1.0
    head = w["lm_head.weight"]
    head.zero_()
    head[the, 0], head[eos, 1] = 20.0, 50.0
    save_file(w, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    chat = Path(tiny_model_dir(root / "chat", tie=False))
    plain = Path(tiny_model_dir(root / "plain", tie=False))
    (plain / "chat_template.jinja").unlink()
    for folder in (chat, plain):
        answers_the(folder)
    return {"template": str(chat), "plain": str(plain),
            "base gguf": str(write_gguf_from_hf(plain, root / "base.gguf", "Q8_0"))}


def turn_reuses_the_cache(session, text: str) -> None:
    """A turn whose prompt reads only what the cache does not hold yet: the new message and the pending token."""
    cached, kept = session.seq.num_tokens, list(session.token_ids[:session.seq.num_tokens])
    assert cached > 0
    reply = session.reply(text, ONE)
    assert reply == " the"
    prompt = len(session.token_ids) - 1               # the reply's one token is not in the prompt
    assert session.token_ids[:cached] == kept
    assert session.stats().prefill_tokens == prompt - cached


@pytest.mark.parametrize("fmt", ["template", "plain", "base gguf"])
def test_every_format_reuses_its_prefix_and_its_saved_cache(models, fmt, tmp_path):
    engine = Engine.load(EngineConfig(model=models[fmt]))
    assert (engine.chat_format_notice is None) == (fmt == "template")
    engine._warm_store = WarmStore(tmp_path / "kv")
    s = engine.new_session(prefix_cache=False)        # no prefix cache to hide a chat read again
    engine.keep_warm(s, "c")
    for text in ("Hello there", "Tell me more"):
        assert s.reply(text, ENDS) == " the"
    assert s.token_ids[-1] in engine.stop_ids        # each reply ended on its own
    assert engine.save_warm(s) > 0
    turn_reuses_the_cache(s, "And again")
    # relaunched: the app opens the conversation with its messages and reads the saved cache back
    again = engine.new_session(history=s.messages[:4], prefix_cache=False)
    engine.keep_warm(again, "c")
    assert engine.restore_warm(again).tokens > 0
    turn_reuses_the_cache(again, "And again")
    assert again.token_ids == s.token_ids
    # the reply cut at its token limit: its last token is pending, and the next turn reads it with the message
    turn_reuses_the_cache(again, "Once more")
    for x in (s, again):
        x.close()


def test_the_plain_format_writes_a_reply_as_the_model_gave_it(models):
    """One space after "Assistant:" for a message written without one; none added to a reply that has its own."""
    from kvchat.engine.text.chat_format import encode_conversation
    from kvchat.engine.text.tokenizer_cache import load_tokenizer
    tok = load_tokenizer(Path(models["plain"]))
    text, _ = encode_conversation(tok, None, [{"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": " the"},
                                              {"role": "user", "content": "More"},
                                              {"role": "assistant", "content": "Hello."},
                                              {"role": "user", "content": "Bye"}])
    assert text == "User: Hi\nAssistant: the\nUser: More\nAssistant: Hello.\nUser: Bye\nAssistant:"
