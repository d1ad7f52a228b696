"""What a machine without the C kernels runs: KVCHAT_NO_CPU_KERNELS=1 makes kernels/cpu_lib.py refuse the library,
so every step takes torch's kernels. The fallback must give the same greedy reply, serve requests, and say that
it is running (it is several times slower), in the terminal and in the app's status line.

The library is asked for once per process, so the runs without it are subprocesses."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from kvchat.engine import SamplingParams
from fakes import FakeLoader, isolate_app, open_window
from serve_process import kvchat as _kvchat, start_serve

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "What is the capital of France?"
DISABLED = "C kernels not loaded (disabled by KVCHAT_NO_CPU_KERNELS): running torch's kernels, several times slower"


def _env(no_kernels: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVCHAT_NO_CPU_KERNELS", "KVCHAT_NO_QUICK")}
    return {**env, "KVCHAT_NO_CPU_KERNELS": "1"} if no_kernels else env


# ---- the status line ---------------------------------------------------------------------------------------------

def test_kernel_status_says_why_on_cpu_and_nothing_on_cuda(monkeypatch):
    from kvchat.engine.runtime.engine import kernel_status
    from kvchat.kernels import cpu_quant
    monkeypatch.setattr(cpu_quant, "available", lambda: False)
    monkeypatch.setattr(cpu_quant, "unavailable_reason", lambda: "no C compiler found (cc / gcc)")
    assert kernel_status("cpu") == ("C kernels not loaded (no C compiler found (cc / gcc)): running torch's kernels, "
                                    "several times slower")
    assert kernel_status("cuda:0") is None          # CPU kernels: a GPU engine does not miss them
    monkeypatch.setattr(cpu_quant, "available", lambda: True)
    assert kernel_status("cpu") is None


def test_an_engine_with_the_kernels_says_nothing(tiny_engine):
    from kvchat.kernels import cpu_quant
    assert cpu_quant.available(), cpu_quant.unavailable_reason()    # the rest of the suite runs them
    from kvchat.kernels import cpu_lib
    if cpu_lib.status()["variant"] == "baseline":     # a CPU without AVX2: said too (tests/test_kernel_variants.py)
        pytest.skip("the baseline build is said in the status line")
    assert tiny_engine.kernel_status is None


class _NoKernelsLoader(FakeLoader):
    """The fake engine, as a machine without the C kernels loads it."""

    def __call__(self, config, progress):
        engine = super().__call__(config, progress)
        engine.kernel_status = DISABLED
        return engine


def _status_after_load(qtbot, loader) -> str:
    window = open_window(qtbot, loader, autoload=False)
    window.load_engine()
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    return window.status_label.text()


@pytest.mark.gui
def test_the_status_line_says_the_kernels_are_missing(qtbot, monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)
    assert DISABLED in _status_after_load(qtbot, _NoKernelsLoader())
    assert "C kernels" not in _status_after_load(qtbot, FakeLoader())


@pytest.mark.gui
def test_the_status_line_says_it_in_chinese(qtbot, monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)
    monkeypatch.setenv("KVCHAT_LANG", "zh_CN")
    from PySide6.QtWidgets import QApplication

    from kvchat.app import i18n
    app = QApplication.instance() or QApplication([])
    assert i18n.install(app, "en") == "zh_CN"
    try:
        status = _status_after_load(qtbot, _NoKernelsLoader())
    finally:
        for translator in app._kvchat_translators:     # other tests read English
            app.removeTranslator(translator)
        app._kvchat_translators = []
    assert "C 内核未加载（disabled by KVCHAT_NO_CPU_KERNELS）" in status and "several times" not in status


# ---- a chat turn and a serve request without them ----------------------------------------------------------------

@pytest.mark.slow
def test_a_greedy_chat_turn_without_the_kernels_gives_the_same_reply():
    """`kvchat chat --prompt` on the default model: without the kernels (which also rules out the torch-free
    one-shot path) the greedy reply is the one the kernels give, and stderr says why it is slow."""
    args = _kvchat("chat", "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "16")
    fast = subprocess.run(args, cwd=ROOT, env=_env(False), capture_output=True, text=True, timeout=300)
    slow = subprocess.run(args, cwd=ROOT, env=_env(True), capture_output=True, text=True, timeout=600)
    assert fast.returncode == 0 and slow.returncode == 0, fast.stderr + slow.stderr
    assert "Paris" in fast.stdout
    assert slow.stdout == fast.stdout
    assert slow.stderr.splitlines() == [f"kvchat: {DISABLED}"]
    assert "C kernels" not in fast.stderr


def test_a_serve_request_without_the_kernels_gives_the_same_completion(tiny_llama, tiny_engine):
    """`kvchat serve` without the kernels answers an OpenAI chat request with the reply a session with them
    gives, and its startup lines on stderr say the kernels are missing."""
    proc, base = start_serve(["--model", tiny_llama], env=_env(True), cwd=ROOT)
    try:
        body = {"model": Path(tiny_llama).name, "temperature": 0, "max_tokens": 12,
                "messages": [{"role": "user", "content": "Hello! How are you?"}]}
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    session = tiny_engine.new_session()
    events = list(session.send("Hello! How are you?", SamplingParams(temperature=0, max_new_tokens=12)))
    done = events[-1]
    assert choice["message"]["content"] == done.text != ""
    assert choice["finish_reason"] == {"length": "length", "eos": "stop"}[done.finish_reason]
    assert f"kvchat: {DISABLED}" in err.splitlines()
