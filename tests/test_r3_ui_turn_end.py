"""What the screen keeps after something ended is no longer said as if it were live (issue 37, item 8): a reply's
decode rate once the reply has ended reads "last reply" (the dashboard's summary and the status line), and the "no chat
template" banner goes when a model with a template is loaded after one without."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvchat.engine.config import SamplingParams
from fakes import FakeLoader, isolate_app, open_window, real_window
from tiny_models import tiny_model_dir

pytestmark = pytest.mark.gui


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))


def test_after_a_reply_the_rate_is_the_last_replys_not_a_live_one(qtbot):
    """The reply's last snapshot comes while it runs; once it has ended the summary says idle and names the rate as
    the last reply's, and so does the status line; while the next reply runs the rate is live again."""
    window = open_window(qtbot, FakeLoader(step_s=0.02))
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    window.settings = replace(window.settings, sampling=SamplingParams(max_new_tokens=30))
    live: list[str] = []
    window.host.token.connect(lambda _: live.append(window.status_label.text()))
    with qtbot.waitSignal(window.host.turn_finished, timeout=10_000) as finished:
        window.input.setPlainText("Hello there model")
        window.input.submit()
    rate = finished.args[0].stats.decode_tok_s
    assert rate > 0 and window.dashboard.data.latest.decode_tok_s == rate
    window.dashboard.redraw()
    summary = window.dashboard.live.summary.text()
    assert f"idle · last reply: decode {rate:.1f} tok/s" in summary, summary
    assert window.status_label.text().endswith(f"last reply {rate:.1f} tok/s"), window.status_label.text()
    assert any(text.endswith(" tok/s") and "last reply" not in text for text in live)


def test_the_no_template_banner_goes_with_the_model_it_spoke_of(qtbot, tmp_path, tiny_llama):
    """A base model (no chat template) says so in the banner; loading a model with a template takes it away, and
    the status line no longer says plain-text chat. Another banner (a refused load, say) is not taken away."""
    base = tiny_model_dir(tmp_path / "base", seed=5)
    (Path(base) / "chat_template.jinja").unlink()
    window = real_window(qtbot, base)
    assert window.banner.isVisible() and "no chat template" in window.banner.text()
    window.apply_settings(replace(window.settings, model=str(tiny_llama)))
    qtbot.waitUntil(lambda: window.session_ready and window.engine_info.model_name != Path(base).name, timeout=60_000)
    assert not window.banner.isVisible(), window.banner.text()
    assert "plain-text chat" not in window.status_label.text()
    window.banner.show_message("Could not load", "something else")
    window.banner.hide_topic("chat_format")
    assert window.banner.isVisible()
