"""Long or impossible work says so: a benchmark's progress on stderr (`--json` keeps stdout for the result), the app
without a display in one line."""
import io
import json
import os
import subprocess
import sys
import time

from kernel_cache import seeded
from kvchat.bench.progress import Progress


def test_a_stage_is_one_line_and_a_silent_stretch_gets_a_heartbeat():
    out = io.StringIO()
    say = Progress("speed", stream=out)
    say("kvchat run", 1, 3)
    with say.heartbeat(every=0.3):
        time.sleep(1.0)                 # a stage that says nothing for a while
    say.done()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[bench speed") and lines[0].endswith("kvchat run 1/3")
    assert any(line.endswith("kvchat run (still running) 1/3") for line in lines[1:-1]), lines
    assert lines[-1].split("] ", 1)[1].startswith("done in ")


def test_quiet_says_nothing(monkeypatch):
    monkeypatch.setenv("KVCHAT_BENCH_QUIET", "1")
    out = io.StringIO()
    say = Progress("memory", stream=out)
    say("a stage")
    say.done()
    assert out.getvalue() == ""


def test_bench_speed_json_keeps_stdout_clean_and_shows_progress_on_stderr(tmp_path):
    # a cache of its own, holding the kernels the session built (not compiled again in the child)
    env = dict(os.environ, KVCHAT_CACHE_DIR=str(seeded(tmp_path / "cache")), OMP_NUM_THREADS="1")
    env.pop("KVCHAT_BENCH_QUIET", None)
    run = subprocess.run([sys.executable, "-m", "kvchat.cli.main", "bench", "speed", "--json", "--model",
                          "preset:tiny:Q4_0", "--runs", "2", "--prompt-tokens", "16", "--new-tokens", "4",
                          "--no-load", "--transformers", "no", "--no-llamacpp", "--threads", "1"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)             # stdout is the JSON and nothing else
    assert result["runs"] == 2 and result["kvchat"]["decode_tok_s"] > 0
    # which prompt path and decode activations the numbers are of (a forced kernel variant can change the first)
    assert result["prefill"] in ("fp32", "bf16", "int8") and result["prefill_why"] and result["activations"] == "int16"
    progress = [line for line in run.stderr.splitlines() if line.startswith("[bench speed")]
    assert any(line.endswith("run 1/2") for line in progress) and any(line.endswith("run 2/2") for line in progress)
    assert progress[-1].split("] ", 1)[1].startswith("done in ")


def test_the_app_without_a_display_says_so_in_one_line_and_exits(tmp_path):
    """`kvchat` over ssh (no DISPLAY, no Wayland, no Qt platform chosen): one line pointing at `kvchat chat`, exit 2,
    instead of Qt's abort."""
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    env.update(KVCHAT_DATA_DIR=str(tmp_path / "data"), KVCHAT_SETTINGS_FILE=str(tmp_path / "settings.ini"))
    run = subprocess.run([sys.executable, "-m", "kvchat.cli.main"], capture_output=True, text=True, timeout=120,
                         env=env, cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.strip().splitlines() == [run.stderr.strip()] and "kvchat chat" in run.stderr
    assert not (tmp_path / "data").exists()          # nothing was created on the way out
