"""`kvchat bench attention` (issue 43): what a longer cache adds to a decode step, as the rate its pages are read."""
import json
import os
import subprocess
import sys

import pytest

from kernel_cache import seeded


def test_attention_json_reads_each_format_at_its_own_bytes(tmp_path):
    from kvchat.bench.gguf_writer import PRESETS
    tiny = PRESETS["tiny"]
    env = dict(os.environ, KVCHAT_CACHE_DIR=str(seeded(tmp_path / "cache")), OMP_NUM_THREADS="1")
    env.pop("KVCHAT_BENCH_QUIET", None)
    run = subprocess.run([sys.executable, "-m", "kvchat.cli.main", "bench", "attention", "--json", "--model",
                          "preset:tiny:Q4_0", "--contexts", "32,160", "--steps", "3", "--modes", "bf16,int8",
                          "--runs", "2", "--threads", "1"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout)
    assert set(r["modes"]) == {"bf16", "int8"} and r["contexts"] == [32, 160]
    assert r["stream_gb_s"]["runs"] == 2 and 0 < r["stream_gb_s"]["min"] <= r["stream_gb_s"]["median"]
    # the session's own count: a bf16 token is K and V of every layer's kv heads, 2 bytes a channel
    full = tiny.layers * 2 * tiny.kv_heads * tiny.head_dim * 2
    assert r["modes"]["bf16"]["bytes_per_token"] == full
    assert full / 2 < r["modes"]["int8"]["bytes_per_token"] < full      # int8 codes and their scales
    for m in r["modes"].values():
        a, b = m["step_ms"]["32"], m["step_ms"]["160"]
        assert a["runs"] == b["runs"] == 2 and 0 < a["min"] <= a["median"] <= a["max"]
        added = b["median"] - a["median"]
        assert m["added_ms_per_1k_tokens"] == pytest.approx(added / 128 * 1000)
        if added > 0:       # the rate is the extra tokens' bytes over the extra time, and against the stream's
            assert m["read_gb_s"] == pytest.approx(m["bytes_per_token"] * 128 / (added / 1e3) / 1e9)
            assert m["ratio_vs_stream"] == pytest.approx(m["read_gb_s"] / r["stream_gb_s"]["median"])
        else:
            assert m["read_gb_s"] is None and m["ratio_vs_stream"] is None
    assert any(line.endswith("8/8") for line in run.stderr.splitlines() if line.startswith("[bench attention"))


@pytest.mark.parametrize("bad", [["--modes", "fp7"], ["--contexts", "2048,256"], ["--contexts", "512"],
                                 ["--contexts", "8,64"], ["--contexts", "a,b"]])
def test_bad_options_are_one_line(bad):
    from kvchat.cli.terminal import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "attention", *bad])


def test_a_cache_past_the_models_context_is_one_line(tmp_path):
    env = dict(os.environ, KVCHAT_CACHE_DIR=str(seeded(tmp_path / "cache")), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "kvchat.cli.main", "bench", "attention", "--model", "preset:tiny:Q4_0",
                          "--contexts", "32,5000", "--steps", "2", "--modes", "bf16", "--runs", "1", "--threads", "1"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 2 and "Traceback" not in run.stderr and "context of 2,048 tokens" in run.stderr
