"""A long paste shows how far its reading got (issue 37, item 10): the engine says after each prompt chunk how many of
the prompt's tokens the cache holds, and the window shows it in the reply bubble and the dashboard until the first
token. A real tiny engine; the app's test slows each model step so that the reading lasts long enough to be seen."""
from __future__ import annotations

import re

import pytest

from kvchat.engine.config import SamplingParams
from kvchat.engine.events import PrefillProgress, TokenDelta, TurnFinished
from kvchat.engine.kv.layout import PREFILL_CHUNK
from fakes import engine_of, isolate_app, real_window, send, slow_steps

SHORT = SamplingParams(temperature=0, max_new_tokens=4)
LONG = " ".join(f"word{i % 97} and more" for i in range(200))        # about 2,400 tokens: five prompt chunks


def test_a_long_prompt_says_after_each_chunk_how_far_it_got(tiny_engine):
    """Progress counts the prompt's own tokens, one chunk more each time, ends at the whole prompt (the prefill the
    turn reports), and comes before any token; a prompt of one chunk says nothing."""
    session = tiny_engine.new_session()
    events = list(session.send(LONG, SHORT))
    progress = [e for e in events if isinstance(e, PrefillProgress)]
    total = events[-1].stats.prefill_tokens
    assert total > 2 * PREFILL_CHUNK and isinstance(events[-1], TurnFinished)
    assert [p.done for p in progress] == [min(total, (i + 1) * PREFILL_CHUNK) for i in range(len(progress))]
    assert progress[-1].done == total and {p.total for p in progress} == {total}
    first_token = next(i for i, e in enumerate(events) if isinstance(e, TokenDelta))
    assert all(isinstance(e, PrefillProgress) for e in events[:len(progress)]) and first_token == len(progress)
    again = list(session.send("Short one.", SHORT))
    assert not any(isinstance(e, PrefillProgress) for e in again)


def test_a_stopped_reading_leaves_the_chat_as_it_was(tiny_engine):
    """Closing the stream between two chunks (a Stop, the window going away) takes the prompt back, as before."""
    session = tiny_engine.new_session()
    list(session.send("Hello there.", SHORT))
    held, messages = session.stats().tokens_in_context, list(session.messages)
    stream = session.send(LONG, SHORT)
    assert isinstance(next(stream), PrefillProgress)
    stream.close()
    assert session.messages == messages and session.stats().tokens_in_context == held


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.gui
def test_the_window_shows_the_reading_in_the_reply_and_the_dashboard(qtbot, monkeypatch, tiny_llama):
    """"reading your message: 512 / N tokens…" in the empty reply and the dashboard's summary while the prompt is
    read, with the engine's own count; gone once the reply comes."""
    window = real_window(qtbot, str(tiny_llama), sampling=SHORT)
    send(qtbot, window, "Hello there.")                  # the chat is in the cache: only the new message is read
    slow_steps(monkeypatch, engine_of(window), 0.3)
    seen: list[str] = []
    window.host.reading.connect(lambda event: seen.append(window.chat.chat_messages()[-1].text()))
    finished = send(qtbot, window, LONG)
    total = finished.stats.prefill_tokens
    shown = [text for text in seen if text.startswith("reading your message")]
    assert shown and shown[0] == f"reading your message: {PREFILL_CHUNK:,} / {total:,} tokens…", seen
    numbers = [tuple(int(n.replace(",", "")) for n in re.findall(r"[\d,]+", text)) for text in shown]
    assert all(t == total for _, t in numbers) and [d for d, _ in numbers] == sorted(d for d, _ in numbers)
    window.dashboard.redraw()
    assert window.dashboard.live.reading == "" and "reading" not in window.dashboard.live.summary.text()
    assert window.chat.chat_messages()[-1].text() == finished.text
