"""Chat templates under a time and size limit: a hostile or broken template costs one line, never the app."""
import json
import shutil
import time
from pathlib import Path

import pytest

from kvchat.engine import Engine, EngineConfig, SamplingParams
from kvchat.engine.text.chat_format import ChatTemplateError
from kvchat.engine.text.chat_template import TemplateLimit, render
from kvchat.engine.config import ConfigError
from tiny_models import CHATML_TEMPLATE

MSGS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
SPIN = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
GREEDY = SamplingParams(temperature=0, max_new_tokens=4)


def model_with_template(base: str, folder: Path, template: str) -> str:
    """A copy of a tiny model folder whose chat template is `template` (as a downloaded model would bring it)."""
    shutil.copytree(base, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(template)
    return str(folder)


def when_system(hostile: str) -> str:
    """ChatML that turns hostile when the conversation has a system prompt (the load probe has none)."""
    return "{% if messages[0]['role'] == 'system' %}" + hostile + "{% endif %}" + CHATML_TEMPLATE


HOSTILE = {     # name: (template, what the limit says)
    "nested loops": (SPIN, "limit"),
    "exponential macro": ("{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}",
                          "limit"),
    "endless recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "without end"),
    "repetition": ("{{ 'x' * 400000000 }}", "400,000,000"),
    "power": ("{{ 2 ** 1000000000 }}", "power"),
    "doubling": ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                 "built a value"),
    "squaring replace": ("{% set s = 'x' * 100000 %}{{ s.replace('x', s) }}", "work"),
    "wide filter": ("{{ 'x' | center(1000000000) }}", "work"),
    "many slices": ("{{ messages | slice(1000000000) | list }}", "work"),
    "format width": ("{{ '%1000000000s' % 'x' }}", "format width"),
    "literal flood": ("{% for a in range(100000) %}{% for b in range(1000) %}xxxxxxxxxx{% endfor %}{% endfor %}",
                      "wrote more than"),
    "buffered flood": ("{% set s = 'y' * 100000 %}{% macro m() %}{% for a in range(100000) %}{{ s }}{% endfor %}"
                       "{% endmacro %}{% set t = m() %}", "wrote more than"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_template_is_stopped_quickly(name):
    """Each runaway (time, memory, output) ends in TemplateLimit within its deadline, before allocating it all."""
    template, words = HOSTILE[name]
    started = time.monotonic()
    with pytest.raises(TemplateLimit, match=words):
        render(template, MSGS, True, timeout_s=1.0)
    assert time.monotonic() - started < 2.5


def test_the_default_deadline_stops_nested_loops_and_a_real_template_is_unchanged():
    """Under the default limits a nested loop stops in about 3 s; ChatML renders as it always did."""
    started = time.monotonic()
    with pytest.raises(TemplateLimit, match="limit"):
        render(SPIN, MSGS, True)
    assert 2.5 < time.monotonic() - started < 6
    assert render(CHATML_TEMPLATE, MSGS, True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert "lipsum" not in render("{{ lipsum is defined and 'lipsum' or '' }}", MSGS)


def test_a_long_chat_of_short_messages_is_not_taken_for_a_flood():
    """The output limit grows with the messages: 50,000 short turns of ChatML (1.45 M characters) render."""
    chat = [{"role": "user", "content": "x"}] * 50_000
    assert len(render(CHATML_TEMPLATE, chat)) == 50_000 * len("<|im_start|>user\nx<|im_end|>\n")


def test_numbers_and_widths_a_real_template_uses_pass():
    assert render("{{ '{}'.format(1700000000) }}|{{ '%d' | format(1700000000) }}|{{ 'ab'.center(6) }}", MSGS) == \
        "1700000000|1700000000|  ab  "


def test_the_sandbox_still_holds():
    import jinja2
    with pytest.raises(jinja2.exceptions.SecurityError):
        render("{{ messages.__class__.__mro__ }}", MSGS)
    with pytest.raises(jinja2.exceptions.SecurityError):
        render("{{ ''.__class__.__base__.__subclasses__() }}", MSGS)


@pytest.fixture(scope="module")
def hostile_engines(tiny_llama, tmp_path_factory):
    """One tiny engine per kind of failure, each hostile only when a system prompt is given."""
    root = tmp_path_factory.mktemp("templates")
    kinds = {
        "spin": when_system(SPIN),
        "huge": when_system("{{ 'x' * 400000000 }}"),
        "raises": when_system("{{ raise_exception('System role not supported') }}"),
        "undefined": when_system("{{ messages[0].nothing.deeper }}"),
        "empty": "{% if messages[0]['role'] != 'system' %}" + CHATML_TEMPLATE + "{% endif %}",
    }
    return {k: Engine.load(EngineConfig(model=model_with_template(tiny_llama, root / k, t))) for k, t in kinds.items()}


@pytest.mark.parametrize("kind, words", [("spin", "3 s limit"), ("huge", "400,000,000"),
                                         ("raises", "refused this conversation: System role not supported"),
                                         ("undefined", "UndefinedError"), ("empty", "rendered nothing")])
def test_a_failing_template_is_one_line_naming_the_model_and_the_chat_goes_on(hostile_engines, kind, words):
    """send() raises ChatTemplateError (a ConfigError: the app shows it as is), one line with the model's name and
    what went wrong; the conversation is as it was, and a chat the template handles still works."""
    engine = hostile_engines[kind]
    session = engine.new_session(system_prompt="Be brief.")
    started = time.monotonic()
    with pytest.raises(ChatTemplateError) as e:
        list(session.send("Hello!", GREEDY))
    message = str(e.value)
    assert isinstance(e.value, ConfigError) and "\n" not in message and "Traceback" not in message
    assert engine.model_name in message and words in message
    assert time.monotonic() - started < 6
    assert session.messages == [] and session.token_ids == []
    events = list(engine.new_session().send("Hello!", GREEDY))
    assert events[-1].finish_reason in ("length", "eos") and events[-1].text


@pytest.mark.parametrize("template, words", [
    (SPIN, "3 s limit"),
    ("{{ raise_exception('this template is broken') }}", "this template is broken"),
    ("{% for m in messages %}{% endfor %}", "rendered nothing"),
    ("{% for m in messages %}\n{{ m.content }\n{% endfor %}", "cannot be read"),
])
def test_a_model_whose_template_cannot_render_a_small_chat_is_refused_at_load(tiny_llama, tmp_path, template, words):
    """The load probe: one line naming the model folder, in seconds, before any chat is opened."""
    folder = model_with_template(tiny_llama, tmp_path / "broken-template-model", template)
    started = time.monotonic()
    with pytest.raises(ConfigError) as e:
        Engine.load(EngineConfig(model=folder))
    assert "broken-template-model" in str(e.value) and words in str(e.value) and "\n" not in str(e.value)
    assert time.monotonic() - started < 30
