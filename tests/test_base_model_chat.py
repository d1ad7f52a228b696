"""A model whose file has no chat template (a base model) still chats: the conversation goes as plain text
(engine.text.chat_format.PLAIN_TEMPLATE), the engine says so (Engine.chat_format_notice) and the CLI prints it,
on the engine's path and on the one-shot one; a model with a template is told nothing and renders its own."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvchat.bench.gguf_hf import write_gguf_from_hf
from kvchat.engine.config import CacheConfig, EngineConfig, SamplingParams
from kvchat.engine.events import TurnFinished
from kvchat.engine.text.chat_format import chat_format_notice, encode_conversation
from tiny_models import tiny_model_dir


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(base model GGUF, chat model GGUF) of one tiny Llama, Q8_0, the first without its chat template."""
    root = tmp_path_factory.mktemp("base")
    chat_folder = tiny_model_dir(root / "chat", seed=5)
    base_folder = tiny_model_dir(root / "base", seed=5)
    (Path(base_folder) / "chat_template.jinja").unlink()
    return (write_gguf_from_hf(base_folder, root / "base.gguf", "Q8_0"),
            write_gguf_from_hf(chat_folder, root / "chat.gguf", "Q8_0"))


def test_a_base_model_chats_as_plain_text(files):
    from kvchat.engine.runtime.engine import Engine
    base, chat = files
    engine = Engine.load(EngineConfig(model=str(base), cache=CacheConfig(budget_mb=64)))
    notice = engine.chat_format_notice
    assert notice.startswith("base has no chat template") and "plain text" in notice
    text, _ = encode_conversation(engine.tokenizer, "Be brief.", [{"role": "user", "content": "Hi"},
                                                                  {"role": "assistant", "content": "Hello."},
                                                                  {"role": "user", "content": "Joke?"}])
    # no BOS: this tokenizer does not start a text with one
    assert text == "Be brief.\n\nUser: Hi\nAssistant: Hello.\nUser: Joke?\nAssistant:"
    session = engine.new_session()
    events = list(session.send("Hi", SamplingParams(temperature=0.0, max_new_tokens=4)))
    assert isinstance(events[-1], TurnFinished)
    assert engine.tokenizer.decode(session.token_ids).startswith("User: Hi\nAssistant:")
    with_template = Engine.load(EngineConfig(model=str(chat), cache=CacheConfig(budget_mb=64)))
    assert with_template.chat_format_notice is None
    text, _ = encode_conversation(with_template.tokenizer, None, [{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_the_plain_format_starts_with_bos_where_the_tokenizer_adds_one(files):
    """A tokenizer that starts every text with BOS (a SentencePiece file's default) gets it in the plain format."""
    class Adds:
        chat_template, bos_token, bos_token_id, special_tokens_map = None, "<s>", 1, {"bos_token": "<s>"}

        def encode(self, text, add_special_tokens=True, **_):
            return ([1] if add_special_tokens else []) + [5] * len(text)

    text, _ = encode_conversation(Adds(), None, [{"role": "user", "content": "Hi"}])
    assert text == "<s>User: Hi\nAssistant:" and chat_format_notice(Adds(), "m.gguf").startswith("m.gguf has no")


def test_the_cli_prints_the_notice(files, capsys):
    """`kvchat chat --prompt` on a base model: the notice once on stderr (the one-shot path, which covers this
    file, and the engine's path alike); the reply on stdout."""
    from kvchat.engine.runtime import quick
    base, chat = files
    params = SamplingParams(temperature=0.0, max_new_tokens=3)
    assert quick.one_shot(str(base), "Hi", None, params) == 0
    out = capsys.readouterr()
    assert out.err.count("has no chat template") == 1 and out.out.endswith("\n")
    assert quick.one_shot(str(chat), "Hi", None, params) == 0
    assert "chat template" not in capsys.readouterr().err
    from kvchat.cli.terminal import build_parser, cmd_chat
    args = build_parser(benches=False).parse_args(["chat", "--model", str(base), "--prompt", "Hi", "--seed", "1",
                                                   "--max-new-tokens", "3"])
    assert cmd_chat(args) == 0
    assert capsys.readouterr().err.count("has no chat template") == 1
